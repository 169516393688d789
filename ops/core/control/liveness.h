// Liveness: every rank's own heartbeat, apart from MPI.
//
// MPI cannot tell a slow peer from a lost one: a rank whose host lost its
// link, or that was frozen (SIGSTOP), leaves the others inside a collective
// forever, and TCP under a silent drop waits for hours. So each worker keeps
// one TCP connection to rank 0 and both ends send a small frame every
// interval from a thread of their own (no GIL, no MPI). A peer is lost when
// its connection closes without a goodbye (the process died, or its host
// rebooted) or when nothing came from it for the timeout (frozen, link
// down, packets dropped). Rank 0 then tells the other workers which ranks it
// lost; every rank that learns of a loss prints one line naming the lost
// ranks and their host and ends its process, so the launcher can stop or
// restart the job. A clean shutdown says goodbye first.
//
// Rank 0's port is open to anyone who reaches it, so a connection counts
// only once it has proved the job's key (`key`: rank 0's random bytes,
// shared over MPI, mixed with KERASDIST_JOB_SECRET): the worker sends its
// hello and a nonce, rank 0 answers with its nonce and an HMAC-SHA256 of
// both (proving itself), the worker answers with its own HMAC. Handshakes
// run side by side, each with a deadline, at most kMaxPending at once
// (the oldest is dropped), so idle or half-open connections cannot delay
// the real ones.
#ifndef KERASDIST_CORE_CONTROL_LIVENESS_H_
#define KERASDIST_CORE_CONTROL_LIVENESS_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../status.h"
#include "../transport/communicator.h"

namespace kerasdist::core {

// Why a peer counts as lost.
enum class LostReason : int { kClosed = 1, kSilent = 2 };

struct LostRank {
  int rank;
  LostReason reason;
};

// "host kdt1 (ranks 2, 3): no heartbeat for 30 s (...)": a host whose every
// rank was lost is named as the host; otherwise each rank with its host.
std::string DescribeLost(const std::vector<std::string>& hosts,
                         std::vector<LostRank> lost, double timeout_s);

struct LivenessOptions {
  int rank = 0;
  int size = 1;
  std::vector<std::string> hosts;  // each rank's host, by rank
  double interval_s = 1.0;
  double timeout_s = 30.0;
  // What every connection proves (see above); the same on every rank.
  std::string key;
  // Called once, from the liveness thread, with the line to print when a
  // peer is lost; the default prints it and ends the process (_exit).
  std::function<void(const std::string&)> on_lost;
  // Where this rank's own beats also go (-1: nowhere): with recovery in
  // place, or in a job of one rank, a pipe to the launcher's per-rank
  // wrapper (kerasdist/run/_rank.py), which kills this process once nothing
  // came for `timeout_s` (a frozen rank must die for MPI to tell the
  // survivors; alone, for the launcher to learn of it). The thread
  // writes "arm <timeout_s>\n" as it starts, "beat\n" each interval and
  // "off\n" as it ends (a goodbye, or a loss: the survivors re-form).
  int watchdog_fd = -1;
  // How long losses are collected after the first, so that one line names
  // a host's ranks together; < 0: min(1 s, 2 intervals). 0 where the
  // survivors should hear at once (recovery in place over TCP, where the
  // line is the only news the others get).
  double settle_s = -1;
};

class Liveness;

// How StartLiveness starts the heartbeat: rank 0's interval and timeout
// (seconds) are every rank's; `interface` is where rank 0's address is
// taken first; `recovery`: recovery in place is on (the wrapper's watchdog
// then watches a rank of a larger job too).
struct LivenessStart {
  double interval_s = 1.0;
  double timeout_s = 30.0;
  std::string interface;
  bool recovery = false;
  std::function<void(const std::string&)> on_lost;  // LivenessOptions'
  double settle_s = -1;                             // LivenessOptions'
};

// The ranks this process's heartbeat last reported lost (its line's), in
// the order found; a heartbeat that starts clears them. A TCP job's
// survivors name them to the rendezvous when they re-form
// (kerasdist/rendezvous/reform.py).
std::vector<int> LastLostRanks();

// Collective over `comm` (the job's ranks, over whichever transport;
// start_liveness.cc): starts this rank's heartbeat; *out stays empty for
// one rank or a timeout of 0. Fails on every rank if any rank cannot
// connect.
Status StartLiveness(Communicator& comm, const LivenessStart& start,
                     std::unique_ptr<Liveness>* out);

class Liveness {
 public:
  // Rank 0's listening socket on `address` ("": every interface), port
  // chosen by the OS.
  static Status Listen(const std::string& address, int* fd, int* port);
  // Where rank 0 listens: loopback when every rank shares its network
  // namespace (one host); else the IPv4 address of `interface` (the one
  // the hosts reach each other on, --network-interface) where rank 0 has
  // it; else "" (every interface: nothing better is known).
  static std::string ListenAddress(bool all_local,
                                   const std::string& interface);
  // The IPv4 address of interface `name` ("a.b.c.d"), "" if it has none.
  static std::string InterfaceAddress(const std::string& name);
  // This machine's IPv4 addresses that are up, `prefer`'s interface first,
  // loopback last, as "a.b.c.d" strings.
  static std::vector<std::string> Addresses(const std::string& prefer);
  // A worker: connects to the first of `addresses` that answers and says
  // hello. Rank 0: accepts one hello from every worker (within
  // `timeout_s`; with `size` 1 none, and `listen_fd` may be -1). Either way
  // the thread starts; *out owns it.
  static Status StartWorker(const LivenessOptions& opt,
                            const std::vector<std::string>& addresses, int port,
                            std::unique_ptr<Liveness>* out);
  static Status StartCoordinator(const LivenessOptions& opt, int listen_fd,
                                 std::unique_ptr<Liveness>* out);
  // The worker's half of the handshake on a connected socket `fd`: sends
  // the hello, checks rank 0's proof, sends its own. An error says why.
  static Status Handshake(int fd, const LivenessOptions& opt, double timeout_s);
  static constexpr int kMaxPending = 64;
  static constexpr double kHandshakeS = 5.0;
  ~Liveness();
  // Says goodbye to the peers and joins the thread.
  void Stop();

 private:
  struct Peer {
    int rank = -1;
    int fd = -1;
    double last_heard = 0;  // seconds, steady clock
    bool gone = false;      // said goodbye, or lost
    std::string inbox;      // bytes of a frame not complete yet
  };
  Liveness() = default;
  void Loop();
  void Beat();
  void Feed(const char* text) const;
  void Read(Peer& p, double now);
  bool HandleFrame(Peer& p, const char* frame, double now);
  void CheckSilent(double now);
  void Settle(double now);
  void Report(const std::vector<LostRank>& lost);

  LivenessOptions opt_;
  std::vector<Peer> peers_;  // rank 0: the workers; a worker: rank 0
  int wake_[2] = {-1, -1};   // a pipe that wakes the thread to stop
  std::atomic<bool> stop_{false};
  std::vector<LostRank> lost_;  // found, not reported yet
  double first_lost_at_ = 0;
  std::vector<LostRank> told_;  // a worker: what rank 0 said was lost
  std::thread thread_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_CONTROL_LIVENESS_H_
