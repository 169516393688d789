// The control plane (control_channel.h) over a TcpMesh of its own (channel
// kControl, on listeners apart from the data mesh's): the negotiation's
// small messages, each a frame (a 4-byte magic, a 4-byte length, the
// bytes), in the order sent from one rank to another.
//
// Never waits: SendControl queues the frame and sends what the socket
// takes; PollControl sends more, reads what arrived from every peer (in
// turn, so that no peer starves the others) and returns one whole frame,
// or none. A peer whose connection closed is read to its end (a goodbye
// sent before it arrives) and then no more; sending to it fails, naming
// it, as does a frame that is not one (a wrong magic, a length over
// kMaxFrame), and every call after. A lost or silent peer is for the
// caller's heartbeat to find (liveness.h), as over MPI.
#ifndef KERASDIST_CORE_TRANSPORT_TCP_CONTROL_H_
#define KERASDIST_CORE_TRANSPORT_TCP_CONTROL_H_

#include <memory>
#include <string>
#include <vector>

#include "../control/control_channel.h"
#include "tcp_mesh.h"

namespace kerasdist::core {

class TcpControl : public ControlChannel {
 public:
  static constexpr uint32_t kMaxFrame = 1u << 30;

  explicit TcpControl(std::unique_ptr<TcpMesh> mesh);
  Status SendControl(int dest, std::string bytes) override;
  Status PollControl(bool* got, int* src, std::string* bytes) override;
  Status ProgressSends() override;
  void FlushSends(double timeout_s) override;
  // From any thread: every call from then on fails (TcpMesh::Revoke).
  void Revoke(const std::string& why) { mesh_->Revoke(why); }

 private:
  struct Peer {
    std::string out;  // frames queued, from out_at on not sent yet
    size_t out_at = 0;
    std::string in;  // bytes read, from in_at on not taken yet
    size_t in_at = 0;
    bool closed = false;  // its end was read
  };
  Status Broken(int peer, const std::string& why);
  void Read(int peer);
  bool TakeFrame(int peer, std::string* bytes, Status* error);

  std::unique_ptr<TcpMesh> mesh_;
  std::vector<Peer> peers_;
  int next_ = 0;  // the peer PollControl looks at first
  Status broken_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_TCP_CONTROL_H_
