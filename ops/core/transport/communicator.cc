// The agreements every transport's start makes over its communicators
// (communicator.h).
#include "communicator.h"

#include <sched.h>

#include <vector>

namespace kerasdist::core {

Status AgreeStarted(Communicator& comm, const Status& mine) {
  const int size = comm.size();
  int64_t first = mine.ok() ? size : comm.rank();
  KD_RETURN_IF_ERROR(
      comm.Allreduce(&first, 1, DataType::kInt64, ReduceOp::kMin));
  if (!mine.ok()) return mine;
  if (first == size) return Status::OK();
  return Status::Internal("rank " + std::to_string(first) +
                          "'s start failed (its error says why), so this "
                          "rank's fails too");
}

Status NodeOversubscribed(Communicator& node, bool* oversubscribed) {
  *oversubscribed = false;
  cpu_set_t mine;
  CPU_ZERO(&mine);
  // Unknown (an empty mask) counts as none: the others decide alike.
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) CPU_ZERO(&mine);
  std::vector<cpu_set_t> every(node.size());
  KD_RETURN_IF_ERROR(node.Allgather(&mine, every.data(), sizeof(cpu_set_t)));
  cpu_set_t all;
  CPU_ZERO(&all);
  bool known = true;
  for (cpu_set_t& m : every) {
    known = known && CPU_COUNT(&m) > 0;
    CPU_OR(&all, &all, &m);
  }
  *oversubscribed = known && node.size() > CPU_COUNT(&all);
  return Status::OK();
}

}  // namespace kerasdist::core
