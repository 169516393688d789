#include "local_control.h"

namespace kerasdist::core {

Status LocalMailboxes::Post(int src, int dest, std::string bytes) {
  std::lock_guard<std::mutex> l(mu_);
  if (dest < 0 || dest >= size()) {
    return Status::InvalidArgument("control message from rank " +
                                   std::to_string(src) + " to rank " +
                                   std::to_string(dest) + ", outside [0, " +
                                   std::to_string(size()) + ").");
  }
  if (left_[dest]) {
    return Status::Aborted("control message from rank " + std::to_string(src) +
                           " to rank " + std::to_string(dest) +
                           ", which left.");
  }
  boxes_[dest].emplace_back(src, std::move(bytes));
  return Status::OK();
}

bool LocalMailboxes::Take(int rank, int* src, std::string* bytes) {
  std::lock_guard<std::mutex> l(mu_);
  auto& box = boxes_[rank];
  if (box.empty()) return false;
  *src = box.front().first;
  *bytes = std::move(box.front().second);
  box.pop_front();
  return true;
}

void LocalMailboxes::Leave(int rank) {
  std::lock_guard<std::mutex> l(mu_);
  left_[rank] = true;
  boxes_[rank].clear();
}

}  // namespace kerasdist::core
