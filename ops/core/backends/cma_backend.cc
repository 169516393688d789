// The in-place single-node backend (cma_allreduce.h): peers read each
// other's tensors where they lie.
#include "backends.h"
#include "cma_allreduce.h"
#include "shm_allreduce.h"

namespace kerasdist::core {

namespace {

class CmaBackend : public Backend {
 public:
  CmaBackend(std::unique_ptr<CmaAllreduce> cma, int64_t min_bytes)
      : cma_(std::move(cma)), min_bytes_(min_bytes) {}
  const char* Name() const override { return "cma"; }

  // The allreduces the slots would take (the same sizes, dtypes and ops),
  // but not batches of small tensors: in-place reads pin the peer's pages
  // tensor by tensor, and there one copy through the slots is cheaper (512 x
  // 1 KiB: 0.60 ms a step through the slots, 0.73 ms read in place; 128 x
  // 16 KiB: 0.59 ms against 0.53 ms). A prescale applies to each
  // contribution before the sum: the slots do that in their copy-in.
  bool Enabled(const CollectiveBatch& b) const override {
    if (b.op != OpType::kAllreduce || b.device >= 0 || b.prescale != 1.0 ||
        !ShmAllreduce::Supports(b.dtype, b.reduce_op)) {
      return false;
    }
    const int64_t bytes = b.bytes();
    if (bytes == 0 || bytes < min_bytes_) return false;
    return bytes >= cma_->min_tensor_bytes() *
                        static_cast<int64_t>(b.tensors.size()) ||
           bytes > ShmAllreduce::kMaxSlotBytes;
  }

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t) override {
    segs_.clear();
    for (const BatchTensor& t : b.tensors)
      segs_.push_back({t.input, t.output, t.count});
    return cma_->Allreduce(segs_, b.dtype, b.reduce_op, b.postscale, b.divisor,
                           &b.packed, &b.reduced);
  }

 private:
  std::unique_ptr<CmaAllreduce> cma_;
  int64_t min_bytes_;
  std::vector<CmaAllreduce::Segment> segs_;  // reused by each call
};

}  // namespace

// KERASDIST_CMA_ALLREDUCE, KERASDIST_CMA_MIN_TENSOR_BYTES. Only beside the
// shared-memory slots (KERASDIST_SHM_ALLREDUCE on as well: the batches of
// small tensors it turns down go to them), for the allreduces they would
// take: their smallest size (KERASDIST_SHM_ALLREDUCE_MIN_BYTES) agreed as
// the shm backend agrees it.
Status MakeCmaBackend(const Config& config, const NodeContext& ctx,
                      std::unique_ptr<Backend>* out) {
  out->reset();
  std::unique_ptr<CmaAllreduce> cma;
  KD_RETURN_IF_ERROR(
      CmaAllreduce::Create(ctx.comm, ctx.one_node(),
                           config.Flag("KERASDIST_SHM_ALLREDUCE") &&
                               config.Flag("KERASDIST_CMA_ALLREDUCE"),
                           config.Int("KERASDIST_CMA_MIN_TENSOR_BYTES"), &cma));
  if (!cma) return Status::OK();
  int64_t shm_min_bytes = 0;
  KD_RETURN_IF_ERROR(
      AgreeLargest(*ctx.comm, config.Int("KERASDIST_SHM_ALLREDUCE_MIN_BYTES"),
                   &shm_min_bytes));
  *out = std::make_unique<CmaBackend>(std::move(cma), shm_min_bytes);
  return Status::OK();
}

}  // namespace kerasdist::core
