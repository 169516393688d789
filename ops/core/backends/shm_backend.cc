// The shared-memory slot backend (shm_allreduce.h): allreduce for jobs whose
// ranks all share one node.
#include <algorithm>

#include "../scale.h"
#include "backends.h"
#include "shm_allreduce.h"

namespace kerasdist::core {

namespace {

using Clock = std::chrono::steady_clock;

class ShmBackend : public Backend {
 public:
  ShmBackend(std::unique_ptr<ShmAllreduce> shm, Backend* fallback)
      : shm_(std::move(shm)), fallback_(fallback) {}
  const char* Name() const override { return "shm"; }

  // Smaller allreduces go to MPI: their cost is latency, and there the
  // barriers were no faster than MPI's small-message path (4 KiB: even;
  // 64 KiB: shared memory 10-20% faster). The minimum is agreed at start-up.
  bool Enabled(const CollectiveBatch& b) const override {
    if (b.op != OpType::kAllreduce || b.device >= 0 ||
        !ShmAllreduce::Supports(b.dtype, b.reduce_op)) {
      return false;
    }
    const int64_t bytes = b.bytes();
    return bytes > 0 && bytes >= shm_->min_bytes() &&
           (bytes <= ShmAllreduce::kMaxSlotBytes || b.tensors.size() == 1);
  }

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t tag) override {
    if (b.bytes() > ShmAllreduce::kMaxSlotBytes) return Pieces(b, tag);
    const int64_t esize = DataTypeSize(b.dtype);
    char* slot = nullptr;
    KD_RETURN_IF_ERROR(shm_->Begin(b.bytes(), &slot));
    // The ranks could not all map a slot this large: the same answer on
    // every rank, so all of them hand the batch on.
    if (slot == nullptr) return fallback_->Run(b, tag);
    int64_t off = 0;
    for (const BatchTensor& t : b.tensors) {
      ScaleCopy(slot + off * esize, t.input, t.count, b.dtype, b.prescale);
      off += t.count;
    }
    b.packed = Clock::now();
    KD_RETURN_IF_ERROR(shm_->Reduce(b.elements(), b.dtype, b.reduce_op));
    b.reduced = Clock::now();
    off = 0;
    for (BatchTensor& t : b.tensors) {
      shm_->CopyOut(off, t.count, b.dtype, t.output, b.postscale, b.divisor);
      off += t.count;
    }
    return Status::OK();
  }

 private:
  // One tensor larger than a slot, a slot's worth at a time.
  Status Pieces(CollectiveBatch& b, uint64_t tag) {
    BatchTensor& t = b.tensors[0];
    const int64_t esize = DataTypeSize(b.dtype);
    const int64_t piece = ShmAllreduce::kMaxSlotBytes / esize;
    for (int64_t first = 0; first < t.count; first += piece) {
      const int64_t m = std::min(piece, t.count - first);
      char* slot = nullptr;
      KD_RETURN_IF_ERROR(shm_->Begin(m * esize, &slot));
      if (slot == nullptr) {
        // Only the first piece can be refused (later ones are no larger),
        // and every rank gets the same answer.
        if (first == 0) return fallback_->Run(b, tag);
        return Status::Internal(
            "shared-memory slot lost mid-tensor (kerasdist bug)");
      }
      ScaleCopy(slot, static_cast<const char*>(t.input) + first * esize, m,
                b.dtype, b.prescale);
      KD_RETURN_IF_ERROR(shm_->Reduce(m, b.dtype, b.reduce_op));
      shm_->CopyOut(0, m, b.dtype, static_cast<char*>(t.output) + first * esize,
                    b.postscale, b.divisor);
    }
    return Status::OK();
  }

  std::unique_ptr<ShmAllreduce> shm_;
  Backend* fallback_;
};

}  // namespace

// KERASDIST_SHM_ALLREDUCE, KERASDIST_SHM_ALLREDUCE_MIN_BYTES. Where the
// ranks of ctx.comm share one node and all have it on; a batch the ranks
// could not get slots for goes to ctx.fallback.
Status MakeShmBackend(const Config& config, const NodeContext& ctx,
                      std::unique_ptr<Backend>* out) {
  out->reset();
  std::unique_ptr<ShmAllreduce> shm;
  KD_RETURN_IF_ERROR(ShmAllreduce::Create(
      ctx.comm, config.shm_allreduce, config.shm_allreduce_min_bytes, &shm));
  if (shm) *out = std::make_unique<ShmBackend>(std::move(shm), ctx.fallback);
  return Status::OK();
}

}  // namespace kerasdist::core
