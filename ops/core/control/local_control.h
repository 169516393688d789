// The control plane for ranks that are threads of one process: one mailbox
// per rank in a shared LocalMailboxes. A message to a rank that left fails,
// naming it; a rank polling its mailbox never waits (as over MPI, a peer
// that went silent is for the caller's timeouts to notice).
#ifndef KERASDIST_CORE_CONTROL_LOCAL_CONTROL_H_
#define KERASDIST_CORE_CONTROL_LOCAL_CONTROL_H_

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "control_channel.h"

namespace kerasdist::core {

class LocalMailboxes {
 public:
  explicit LocalMailboxes(int size) : boxes_(size), left_(size, false) {}
  int size() const { return static_cast<int>(boxes_.size()); }
  Status Post(int src, int dest, std::string bytes);
  bool Take(int rank, int* src, std::string* bytes);
  void Leave(int rank);

 private:
  std::mutex mu_;
  std::vector<std::deque<std::pair<int, std::string>>> boxes_;
  std::vector<bool> left_;
};

class LocalControl : public ControlChannel {
 public:
  LocalControl(std::shared_ptr<LocalMailboxes> boxes, int rank)
      : boxes_(std::move(boxes)), rank_(rank) {}
  // Leaves: later messages to this rank fail on the sender's side.
  ~LocalControl() override { boxes_->Leave(rank_); }
  LocalControl(const LocalControl&) = delete;
  LocalControl& operator=(const LocalControl&) = delete;

  Status SendControl(int dest, std::string bytes) override {
    return boxes_->Post(rank_, dest, std::move(bytes));
  }
  Status PollControl(bool* got, int* src, std::string* bytes) override {
    *got = boxes_->Take(rank_, src, bytes);
    return Status::OK();
  }

 private:
  std::shared_ptr<LocalMailboxes> boxes_;
  const int rank_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_CONTROL_LOCAL_CONTROL_H_
