#include "backend.h"

namespace kerasdist::core {

int64_t CollectiveBatch::elements() const {
  int64_t n = 0;
  for (const BatchTensor& t : tensors) n += t.count;
  return n;
}

Status Backend::Run(CollectiveBatch& b, uint64_t tag) {
  b.backend = Name();
  switch (b.op) {
    case OpType::kAllreduce:
      return Allreduce(b, tag);
    case OpType::kAllgather:
      return Allgather(b, tag);
    case OpType::kBroadcast:
      return Broadcast(b, tag);
    case OpType::kAlltoall:
      return Alltoall(b, tag);
    case OpType::kReducescatter:
      return Reducescatter(b, tag);
    case OpType::kBarrier:
      return Barrier(b, tag);
    case OpType::kJoin:
      break;  // the runtime completes joins itself
  }
  return Unsupported(b.op);
}

Status Backend::Unsupported(OpType op) const {
  return Status::Internal(std::string("the '") + Name() +
                          "' backend does not "
                          "implement " +
                          OpTypeName(op) +
                          " (kerasdist bug: its "
                          "Enabled() accepted the batch).");
}

Status Backend::Allreduce(CollectiveBatch& b, uint64_t) {
  return Unsupported(b.op);
}
Status Backend::Allgather(CollectiveBatch& b, uint64_t) {
  return Unsupported(b.op);
}
Status Backend::Broadcast(CollectiveBatch& b, uint64_t) {
  return Unsupported(b.op);
}
Status Backend::Alltoall(CollectiveBatch& b, uint64_t) {
  return Unsupported(b.op);
}
Status Backend::Reducescatter(CollectiveBatch& b, uint64_t) {
  return Unsupported(b.op);
}
Status Backend::Barrier(CollectiveBatch& b, uint64_t) {
  return Unsupported(b.op);
}

Backend* ChooseBackend(const BackendList& list, const CollectiveBatch& b) {
  for (const auto& backend : list) {
    if (backend->Enabled(b)) return backend.get();
  }
  return nullptr;
}

}  // namespace kerasdist::core
