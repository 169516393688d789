// Adasum allreduce (op=kerasdist.Adasum), as Horovod computes it
// (horovod/common/ops/adasum/adasum.h): recursive vector halving with
// distance doubling over point-to-point messages (Communicator::SendRecv)
// on the job's communicator,
// for a power-of-two number of ranks (validate.cc refuses the others).
//
// At level L = 1, 2, 4, ... rank r pairs with r ^ L: the lower rank keeps
// the first half of what it holds, the upper one the second half, and each
// combines its half with the neighbour's copy of it,
//   a' = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b
// (a coefficient stays 1 where its norm is below sqrt(DBL_MIN)), where a is
// always the lower block's partial result. The dot product and the norms are
// those of whole tensors: every tensor of a fused batch keeps its own, and
// the partial sums of the 2L ranks that hold a tensor's pieces are added
// (recursive doubling, which gives every rank the same bits). Then the
// halves travel back (distance halving) until every rank holds the result.
// The arithmetic is in double; float16 is widened and rounded once per
// level, as Horovod's vector path does.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "../half.h"
#include "../host_buffer.h"
#include "../scale.h"
#include "backends.h"

namespace kerasdist::core {

namespace {

using Clock = std::chrono::steady_clock;

double Load(DataType dt, const char* p, int64_t i) {
  switch (dt) {
    case DataType::kFloat16:
      return HalfToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    case DataType::kFloat32:
      return reinterpret_cast<const float*>(p)[i];
    default:
      return reinterpret_cast<const double*>(p)[i];
  }
}

// a[i] = ac * a[i] + bc * b[i], rounded once to the dtype (float16: in
// float, with the coefficients rounded to float, as Horovod's F16C path).
void ScaledAdd(DataType dt, int64_t n, double ac, char* a, double bc,
               const char* b) {
  if (dt == DataType::kFloat16) {
    auto* x = reinterpret_cast<uint16_t*>(a);
    auto* y = reinterpret_cast<const uint16_t*>(b);
    const float fa = static_cast<float>(ac), fb = static_cast<float>(bc);
    for (int64_t i = 0; i < n; ++i)
      x[i] =
          FloatToHalf(std::fmaf(fb, HalfToFloat(y[i]), fa * HalfToFloat(x[i])));
  } else if (dt == DataType::kFloat32) {
    auto* x = reinterpret_cast<float*>(a);
    auto* y = reinterpret_cast<const float*>(b);
    for (int64_t i = 0; i < n; ++i)
      x[i] = static_cast<float>(ac * x[i] + bc * y[i]);
  } else {
    auto* x = reinterpret_cast<double*>(a);
    auto* y = reinterpret_cast<const double*>(b);
    for (int64_t i = 0; i < n; ++i) x[i] = ac * x[i] + bc * y[i];
  }
}

class AdasumBackend : public Backend {
 public:
  explicit AdasumBackend(Communicator* comm)
      : comm_(comm), rank_(comm->rank()), size_(comm->size()) {}
  const char* Name() const override { return "adasum"; }
  bool Enabled(const CollectiveBatch& b) const override {
    return b.op == OpType::kAllreduce && b.reduce_op == ReduceOp::kAdasum &&
           b.device < 0;
  }

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t tag) override;

 private:
  Status SumWithin(std::vector<double>& v, int level);
  Status Reduce(DataType dt, char* grad, char* recv,
                std::vector<int64_t>& counts);
  Status Combine(DataType dt, char* a, const char* b,
                 const std::vector<int64_t>& counts, int level, bool left);

  Communicator* comm_;
  int rank_, size_;
  HostBuffer grad_, recv_;
  std::vector<double> sums_, peer_;
};

// Adds `v` over the 2 * level ranks of this rank's block (those that differ
// from it in the bits below 2 * level), by recursive doubling.
Status AdasumBackend::SumWithin(std::vector<double>& v, int level) {
  peer_.resize(v.size());
  const int64_t bytes = static_cast<int64_t>(v.size() * sizeof(double));
  for (int mask = 1; mask <= level; mask <<= 1) {
    KD_RETURN_IF_ERROR(comm_->SendRecv(v.data(), bytes, rank_ ^ mask,
                                       peer_.data(), bytes, rank_ ^ mask));
    for (size_t i = 0; i < v.size(); ++i) v[i] += peer_[i];
  }
  return Status::OK();
}

// One level's pairwise combination of the pieces this rank holds: `a` (its
// own) and `b` (the neighbour's), tensor by tensor (`counts`).
Status AdasumBackend::Combine(DataType dt, char* a, const char* b,
                              const std::vector<int64_t>& counts, int level,
                              bool left) {
  const int64_t esize = DataTypeSize(dt);
  sums_.assign(counts.size() * 3, 0.0);
  int64_t off = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    double dot = 0, aa = 0, bb = 0;
    for (int64_t i = 0; i < counts[t]; ++i) {
      const double x = Load(dt, a + off, i), y = Load(dt, b + off, i);
      dot += x * y;
      aa += x * x;
      bb += y * y;
    }
    // Slot 1 always holds the lower block's norm, slot 2 the upper one's.
    sums_[t * 3] = dot;
    sums_[t * 3 + 1] = left ? aa : bb;
    sums_[t * 3 + 2] = left ? bb : aa;
    off += counts[t] * esize;
  }
  KD_RETURN_IF_ERROR(SumWithin(sums_, level));
  static const double kTiny = std::sqrt(DBL_MIN);
  off = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    const double dot = sums_[t * 3];
    const double an = left ? sums_[t * 3 + 1] : sums_[t * 3 + 2];
    const double bn = left ? sums_[t * 3 + 2] : sums_[t * 3 + 1];
    const double ac = an >= kTiny ? 1.0 - dot / an * 0.5 : 1.0;
    const double bc = bn >= kTiny ? 1.0 - dot / bn * 0.5 : 1.0;
    ScaledAdd(dt, counts[t], ac, a + off, bc, b + off);
    off += counts[t] * esize;
  }
  return Status::OK();
}

// Splits `counts` (this rank's elements of each tensor, in order) at `keep`
// elements from the front (lower) or the back (upper): what stays in
// `counts`, what goes to the neighbour in `given`.
void Split(std::vector<int64_t>& counts, int64_t keep, bool lower,
           std::vector<int64_t>* given) {
  given->assign(counts.size(), 0);
  const int64_t total = [&] {
    int64_t n = 0;
    for (int64_t c : counts) n += c;
    return n;
  }();
  // Elements [lo, hi) of the concatenation stay.
  const int64_t lo = lower ? 0 : total - keep, hi = lower ? keep : total;
  int64_t start = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    const int64_t end = start + counts[t];
    const int64_t kept =
        std::max<int64_t>(0, std::min(end, hi) - std::max(start, lo));
    (*given)[t] = counts[t] - kept;
    counts[t] = kept;
    start = end;
  }
}

// The tree over `grad` (the batch, packed), `recv` as the scratch buffer.
Status AdasumBackend::Reduce(DataType dt, char* grad, char* recv,
                             std::vector<int64_t>& counts) {
  const int64_t esize = DataTypeSize(dt);
  int64_t mine = 0;
  for (int64_t c : counts) mine += c;
  std::vector<std::vector<int64_t>> given;
  for (int level = 1; level < size_; level <<= 1) {
    const bool lower = (rank_ & level) == 0;
    const int64_t first = mine >> 1, second = mine - first;
    const int64_t keep = lower ? first : second, send = mine - keep;
    given.emplace_back();
    Split(counts, keep, lower, &given.back());
    // The lower rank keeps its front, the upper its back.
    char* kept = lower ? grad : grad + send * esize;
    const char* out = lower ? grad + keep * esize : grad;
    KD_RETURN_IF_ERROR(comm_->SendRecv(out, send * esize, rank_ ^ level, recv,
                                       keep * esize, rank_ ^ level));
    KD_RETURN_IF_ERROR(Combine(dt, kept, recv, counts, level, lower));
    grad = kept;
    mine = keep;
  }
  for (int level = size_ >> 1; level > 0; level >>= 1) {
    const bool lower = (rank_ & level) == 0;
    int64_t theirs = 0;
    for (size_t t = 0; t < counts.size(); ++t) {
      theirs += given.back()[t];
      counts[t] += given.back()[t];
    }
    given.pop_back();
    char* into = lower ? grad + mine * esize : grad - theirs * esize;
    KD_RETURN_IF_ERROR(comm_->SendRecv(grad, mine * esize, rank_ ^ level, into,
                                       theirs * esize, rank_ ^ level));
    if (!lower) grad = into;
    mine += theirs;
  }
  return Status::OK();
}

Status AdasumBackend::Allreduce(CollectiveBatch& b, uint64_t) {
  const int64_t esize = DataTypeSize(b.dtype);
  const int64_t total = b.elements();
  char* buf = grad_.Reserve(total * esize);
  char* recv = recv_.Reserve(total * esize);
  std::vector<int64_t> counts;
  int64_t off = 0;
  for (const BatchTensor& t : b.tensors) {
    ScaleCopy(buf + off * esize, t.input, t.count, b.dtype, b.prescale);
    counts.push_back(t.count);
    off += t.count;
  }
  b.packed = Clock::now();
  KD_RETURN_IF_ERROR(Reduce(b.dtype, buf, recv, counts));
  b.reduced = Clock::now();
  off = 0;
  for (BatchTensor& t : b.tensors) {
    ScaleCopy(t.output, buf + off * esize, t.count, b.dtype, b.postscale,
              b.divisor);
    off += t.count;
  }
  return Status::OK();
}

}  // namespace

// Every host Adasum allreduce of a job of two or more ranks (one rank: the
// 'self' backend, the identity). Not in the hierarchical backend's per-host
// list: Adasum is across all ranks, never within a node then across.
Status MakeAdasumBackend(const Config&, const NodeContext& ctx,
                         std::unique_ptr<Backend>* out) {
  out->reset();
  if (ctx.within_node || ctx.comm->size() < 2) return Status::OK();
  *out = std::make_unique<AdasumBackend>(ctx.comm);
  return Status::OK();
}

}  // namespace kerasdist::core
