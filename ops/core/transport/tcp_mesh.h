// A full mesh of TCP connections between the ranks of a job, the ground of
// a transport that can be formed again in a running process (MPI's cannot:
// MPI_Init runs once, and Open MPI's process manager ends the job when it
// loses a host). A job that loses a rank, or gains one, drops its mesh and
// forms a new one among the ranks it has, with a new generation number.
//
// Forming: every rank listens first (Listen) and learns every rank's
// address from a rendezvous; rank r then dials every rank below it and
// accepts one connection from every rank above it. Every port is open to
// anyone who reaches it, so a connection counts only once both ends proved
// the job's key: the dialer sends a hello (channel, generation, its rank,
// the rank it dials, a nonce), the listener answers with its nonce and an
// HMAC-SHA256 of both under the key, the dialer with its own HMAC. A
// listener handles handshakes side by side, each with a deadline, at most
// kMaxPending at once (the oldest dropped), so idle or hostile connections
// cannot hold up the real ones; a hello of another generation (a rank of a
// mesh formed before) is refused.
//
// Moving data: Exchange sends to one rank while receiving from another,
// each message behind a header (what collective, how many bytes) that the
// receiver checks, so ranks that disagree fail with a Status naming both
// sides instead of reading each other's bytes. Nothing waits forever: a
// peer that closes (its process ended, its host went down) fails the call
// at once, one that moves nothing for `timeout_s` (frozen, a cut link)
// after it, both as RanksLost naming the rank. The first failure breaks the
// mesh: every later call fails with it.
#ifndef KERASDIST_CORE_TRANSPORT_TCP_MESH_H_
#define KERASDIST_CORE_TRANSPORT_TCP_MESH_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../status.h"

namespace kerasdist::core {

struct TcpMeshOptions {
  int rank = 0;
  int size = 1;
  // Every rank's listener, "a.b.c.d:port", by rank.
  std::vector<std::string> addresses;
  // What every connection proves; the same on every rank.
  std::string key;
  // The mesh's generation: the same on every rank of one mesh.
  uint64_t generation = 0;
  // What the mesh carries (kData, kControl): each on listeners of its own,
  // and a hello for another is refused.
  uint32_t channel = 0;
  static constexpr uint32_t kData = 0, kControl = 1;
  double connect_timeout_s = 30.0;  // forming the whole mesh
  double timeout_s = 30.0;          // a transfer that moves nothing
};

class TcpMesh {
 public:
  static constexpr int kMaxPending = 64;
  static constexpr double kHandshakeS = 5.0;

  // A listening socket on `address` ("": every interface), port chosen by
  // the OS.
  static Status Listen(const std::string& address, int* fd, int* port);
  // Connects this rank to every other (see above); `listen_fd` stays the
  // caller's. Fails naming the ranks not connected by the deadline.
  static Status Form(const TcpMeshOptions& opt, int listen_fd,
                     std::unique_ptr<TcpMesh>* out);
  ~TcpMesh();  // closes every connection

  int rank() const { return opt_.rank; }
  int size() const { return opt_.size; }
  const TcpMeshOptions& options() const { return opt_; }
  // The connection to `peer` (-1 for this rank), for a channel that moves
  // its own frames (tcp_control.h); Exchange is then not used.
  int fd(int peer) const { return fds_[peer]; }

  // Sends `send_bytes` of `send` to rank `dest` and receives exactly
  // `recv_bytes` from rank `source` into `recv`, side by side (-1: no
  // send, or no receive; never this rank). `what` names the collective;
  // the peer's must match, as must the bytes.
  Status Exchange(const char* what, int dest, const void* send,
                  int64_t send_bytes, int source, void* recv,
                  int64_t recv_bytes);
  // Breaks the mesh: the peers see their connections close, and every
  // later call here fails with `why`.
  void Abort(const std::string& why);
  // Why the mesh broke; OK while it works (the owning thread's view).
  const Status& broken() const { return broken_; }
  // From any thread: shuts every connection down (without closing: the
  // owning thread may be inside Exchange), so that the call in progress
  // and every later one fail, "revoked: `why`", and the peers' fail as
  // their connections end (as MPIX_Comm_revoke does to a communicator).
  void Revoke(const std::string& why);
  bool revoked() const { return revoked_.load(); }
  // Why, once revoked() (read after it).
  const std::string& revoked_why() const { return revoked_why_; }

 private:
  struct Transfer;
  explicit TcpMesh(const TcpMeshOptions& opt);
  Status Dial(int peer, double deadline);
  Status AcceptHigher(int listen_fd, double deadline);
  Status Fail(Status s);
  Status Run(Transfer& t);
  // Fails the mesh: `peer` closed (`verb` "") or "sent" / "took" nothing
  // for the timeout.
  Status Lost(const Transfer& t, int peer, const char* verb);
  Status CheckHeader(const Transfer& t);

  TcpMeshOptions opt_;
  std::vector<int> fds_;  // by rank; -1 for this rank
  Status broken_;
  std::atomic<bool> revoked_{false};
  std::string revoked_why_;  // written before revoked_, read after
};

// "a.b.c.d:port" into its parts; false when it is not one.
bool SplitHostPort(const std::string& address, std::string* host, int* port);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_TCP_MESH_H_
