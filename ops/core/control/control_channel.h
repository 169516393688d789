// The control plane: the small negotiation messages between ranks (ranks
// to the coordinator, the coordinator's decisions back), apart from the data
// plane (communicator.h, backend.h). MpiContext implements it over MPI;
// LocalControl (local_control.h) over in-process mailboxes, so that the
// negotiation protocol can run with ranks as threads.
#ifndef KERASDIST_CORE_CONTROL_CONTROL_CHANNEL_H_
#define KERASDIST_CORE_CONTROL_CONTROL_CHANNEL_H_

#include <string>

#include "../status.h"

namespace kerasdist::core {

class ControlChannel {
 public:
  virtual ~ControlChannel() = default;
  // Queues `bytes` for rank `dest`; never waits for the receiver. Messages
  // from one sender to one receiver arrive in the order sent.
  virtual Status SendControl(int dest, std::string bytes) = 0;
  // Takes one arrived message (*got true, its sender in *src), or none;
  // never waits.
  virtual Status PollControl(bool* got, int* src, std::string* bytes) = 0;
  // Moves queued sends along (a transport that needs it).
  virtual Status ProgressSends() { return Status::OK(); }
  // Waits, at most `timeout_s`, for this rank's sends to leave (shutdown).
  virtual void FlushSends(double timeout_s) {}
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_CONTROL_CONTROL_CHANNEL_H_
