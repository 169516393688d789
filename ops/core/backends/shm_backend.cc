// The shared-memory slot backend (shm_allreduce.h): allreduce,
// reducescatter and allgather for jobs whose ranks all share one node.
#include <algorithm>
#include <cstring>

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

  // Smaller batches go to MPI: their cost is latency, and there the
  // barriers were no faster than MPI's small-message path (allreduce, 4 KiB:
  // even; 64 KiB: shared memory 10-20% faster). The minimum is agreed at
  // start-up and applies to the bytes every rank agrees on: an allreduce's
  // or a reducescatter's input, an allgather's output.
  bool Enabled(const CollectiveBatch& b) const override {
    if (b.device >= 0) return false;
    switch (b.op) {
      case OpType::kAllreduce:
        return ShmAllreduce::Supports(b.dtype, b.reduce_op) &&
               Large(b.bytes()) &&
               (b.bytes() <= ShmAllreduce::kMaxSlotBytes ||
                b.tensors.size() == 1);
      case OpType::kReducescatter:
        return ShmAllreduce::Supports(b.dtype, b.reduce_op) &&
               Large(b.bytes()) && b.tensors.size() == 1 &&
               static_cast<int>(b.counts.size()) == shm_->size();
      case OpType::kAllgather:  // bytes as they are: any dtype
        return b.tensors.size() == 1 &&
               static_cast<int>(b.recv_bytes.size()) == shm_->size() &&
               Large(Sum(b.recv_bytes));
      default:
        return false;
    }
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

  // Each rank copies its input into its slot, a slot's worth at a time,
  // then combines its own part of that piece from every slot straight into
  // its output: one barrier a piece besides Begin's. Its own part, which
  // only it reads, stays in its input unless a prescale applies.
  Status Reducescatter(CollectiveBatch& b, uint64_t tag) override {
    const BatchTensor& t = b.tensors[0];
    const int64_t esize = DataTypeSize(b.dtype);
    const int64_t piece = ShmAllreduce::kMaxSlotBytes / esize;
    const int me = shm_->rank();
    int64_t lo = 0;  // this rank's part: input elements [lo, hi)
    for (int k = 0; k < me; ++k) lo += b.counts[k];
    const int64_t hi = lo + b.counts[me];
    const char* in = static_cast<const char*>(t.input);
    const bool own_in_input = b.prescale == 1.0;
    for (int64_t first = 0; first < t.count; first += piece) {
      const int64_t m = std::min(piece, t.count - first);
      char* slot = nullptr;
      KD_RETURN_IF_ERROR(Slot(m * esize, first, &slot));
      if (slot == nullptr) return fallback_->Run(b, tag);
      // This rank's part of the piece: [a, z), empty where a >= z.
      const int64_t a = std::clamp(lo, first, first + m);
      const int64_t z = std::clamp(hi, a, first + m);
      auto fill = [&](int64_t from, int64_t to) {
        if (from < to) {
          ScaleCopy(slot + (from - first) * esize, in + from * esize, to - from,
                    b.dtype, b.prescale);
        }
      };
      if (own_in_input) {
        fill(first, a);
        fill(z, first + m);
      } else {
        fill(first, first + m);
      }
      KD_RETURN_IF_ERROR(shm_->Publish());
      if (a < z) {
        shm_->ReduceInto(a - first, z - a, b.dtype, b.reduce_op,
                         own_in_input ? in + a * esize : nullptr,
                         static_cast<char*>(t.output) + (a - lo) * esize,
                         b.postscale, b.divisor);
      }
    }
    return Status::OK();
  }

  // Each rank copies its part into its slot, then every rank's part out of
  // theirs; parts larger than a slot go a slot's worth of each at a time.
  Status Allgather(CollectiveBatch& b, uint64_t tag) override {
    const BatchTensor& t = b.tensors[0];
    const std::vector<int64_t>& parts = b.recv_bytes;
    const int me = shm_->rank();
    const int64_t most = *std::max_element(parts.begin(), parts.end());
    const char* in = static_cast<const char*>(t.input);
    char* out = static_cast<char*>(t.output);
    for (int64_t first = 0; first < most;
         first += ShmAllreduce::kMaxSlotBytes) {
      const int64_t m = std::min(ShmAllreduce::kMaxSlotBytes, most - first);
      char* slot = nullptr;
      KD_RETURN_IF_ERROR(Slot(m, first, &slot));
      if (slot == nullptr) return fallback_->Run(b, tag);
      const int64_t own = std::min(m, parts[me] - first);
      if (own > 0) std::memcpy(slot, in + first, own);
      KD_RETURN_IF_ERROR(shm_->Publish());
      int64_t off = 0;  // rank k's part in the output
      for (int k = 0; k < shm_->size(); ++k) {
        const int64_t n = std::min(m, parts[k] - first);
        if (n > 0) std::memcpy(out + off + first, shm_->slot(k), n);
        off += parts[k];
      }
    }
    return Status::OK();
  }

 private:
  bool Large(int64_t bytes) const {
    return bytes > 0 && bytes >= shm_->min_bytes();
  }
  static int64_t Sum(const std::vector<int64_t>& v) {
    int64_t s = 0;
    for (int64_t x : v) s += x;
    return s;
  }

  // This rank's slot for the piece of a batch starting at `first`, of
  // `bytes` (the same on every rank). *slot null: the ranks could not all
  // map it, and the caller hands the whole batch on; only a first piece can
  // be refused (later ones are no larger), and every rank gets the same
  // answer.
  Status Slot(int64_t bytes, int64_t first, char** slot) {
    KD_RETURN_IF_ERROR(shm_->Begin(bytes, slot));
    if (*slot == nullptr && first > 0) {
      return Status::Internal(
          "shared-memory slot lost mid-tensor (kerasdist bug)");
    }
    return Status::OK();
  }

  // One tensor larger than a slot, a slot's worth at a time.
  Status Pieces(CollectiveBatch& b, uint64_t tag) {
    BatchTensor& t = b.tensors[0];
    const int64_t esize = DataTypeSize(b.dtype);
    const int64_t piece = ShmAllreduce::kMaxSlotBytes / esize;
    for (int64_t first = 0; first < t.count; first += piece) {
      const int64_t m = std::min(piece, t.count - first);
      char* slot = nullptr;
      KD_RETURN_IF_ERROR(Slot(m * esize, first, &slot));
      if (slot == nullptr) return fallback_->Run(b, tag);
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
      ctx.comm, ctx.one_node(), config.Flag("KERASDIST_SHM_ALLREDUCE"),
      config.Int("KERASDIST_SHM_ALLREDUCE_MIN_BYTES"), &shm));
  if (shm) *out = std::make_unique<ShmBackend>(std::move(shm), ctx.fallback);
  return Status::OK();
}

}  // namespace kerasdist::core
