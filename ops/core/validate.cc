#include "validate.h"

#include <cmath>
#include <string>

namespace kerasdist::core {

Status PrepareRequest(Request& q, int size, bool have_device_backend) {
  if (q.op == OpType::kAlltoall && q.splits.empty() && !q.shape.empty()) {
    if (q.shape[0] % size != 0) {
      return Status::InvalidArgument(
          "alltoall '" + q.name + "': without splits the first dimension (" +
          std::to_string(q.shape[0]) +
          ") must be divisible by the number of ranks (" +
          std::to_string(size) + "); pass splits.");
    }
    q.splits.assign(size, q.shape[0] / size);
  }
  return ValidateRequest(q, size, have_device_backend);
}

namespace {

bool IsPowerOfTwo(int n) { return n > 0 && (n & (n - 1)) == 0; }

// Adasum (op=kerasdist.Adasum): what Horovod takes (an allreduce of float16,
// float32 or float64 on a power-of-two number of ranks), on host memory.
template <typename What>
Status ValidateAdasum(const Request& q, int size, const What& what) {
  if (q.op != OpType::kAllreduce) {
    return Status::InvalidArgument(
        what() +
        ": the Adasum reduction is only for allreduce; use "
        "kerasdist.Sum or kerasdist.Average here.");
  }
  if (q.dtype != DataType::kFloat16 && q.dtype != DataType::kFloat32 &&
      q.dtype != DataType::kFloat64) {
    return Status::InvalidArgument(
        what() +
        ": the Adasum reduction takes float16, float32 or float64 "
        "tensors; got " +
        DataTypeName(q.dtype) + " (cast to float32 first).");
  }
  if (!IsPowerOfTwo(size)) {
    return Status::InvalidArgument(
        what() +
        ": the Adasum reduction needs a power-of-two number of "
        "ranks (as in Horovod); this job has " +
        std::to_string(size) +
        ". Run on 2, 4, 8, ... ranks or use "
        "kerasdist.Average.");
  }
  if (q.device >= 0) {
    return Status::InvalidArgument(
        what() +
        ": the Adasum reduction runs on host memory only; the "
        "tensor is in GPU memory (copy it to the CPU first).");
  }
  return Status::OK();
}

// An alltoall's splits: one per rank, none negative, adding up to the first
// dimension. `what` names the collective for the error.
template <typename What>
Status ValidateSplits(const Request& q, int size, const What& what) {
  if (static_cast<int>(q.splits.size()) != size) {
    return Status::InvalidArgument(what() +
                                   ": splits must have one entry per rank (" +
                                   std::to_string(size) + "), got " +
                                   std::to_string(q.splits.size()) + ".");
  }
  int64_t sum = 0;
  for (int64_t s : q.splits) {
    if (s < 0)
      return Status::InvalidArgument(what() + ": splits must be >= 0, got " +
                                     ShapeString(q.splits) + ".");
    sum += s;
  }
  if (sum != q.shape[0]) {
    return Status::InvalidArgument(
        what() + ": splits " + ShapeString(q.splits) + " add up to " +
        std::to_string(sum) + " but the first dimension is " +
        std::to_string(q.shape[0]) + ".");
  }
  return Status::OK();
}

}  // namespace

Status ValidateRequest(const Request& q, int size, bool have_device_backend) {
  // Spelled out only for an error: this runs for every tensor of every step.
  auto what = [&q] {
    return std::string(OpTypeName(q.op)) + " '" + q.name + "'";
  };
  if (q.name.empty()) {
    return Status::InvalidArgument(
        "every collective needs a name that is the "
        "same on all ranks; got an empty name.");
  }
  if ((q.op == OpType::kAllreduce || q.op == OpType::kReducescatter) &&
      q.dtype == DataType::kBool) {
    return Status::InvalidArgument(what() +
                                   ": bool tensors cannot be reduced; "
                                   "cast to int32 first.");
  }
  if (q.op == OpType::kBroadcast && (q.root_rank < 0 || q.root_rank >= size)) {
    return Status::InvalidArgument(what() + ": root_rank must be in [0, " +
                                   std::to_string(size) + "), got " +
                                   std::to_string(q.root_rank) + ".");
  }
  if ((q.op == OpType::kAllgather || q.op == OpType::kAlltoall ||
       q.op == OpType::kReducescatter) &&
      q.shape.empty()) {
    return Status::InvalidArgument(what() +
                                   " needs a tensor of at least one "
                                   "dimension; got a scalar.");
  }
  for (int64_t d : q.shape) {
    if (d < 0)
      return Status::InvalidArgument(what() + ": negative dimension in " +
                                     ShapeString(q.shape) + ".");
  }
  if (!std::isfinite(q.prescale) || !std::isfinite(q.postscale)) {
    return Status::InvalidArgument(what() + ": scale factors must be finite.");
  }
  if (q.op == OpType::kAlltoall) {
    KD_RETURN_IF_ERROR(ValidateSplits(q, size, what));
  }
  if (q.reduce_op == ReduceOp::kAdasum &&
      (q.op == OpType::kAllreduce || q.op == OpType::kReducescatter)) {
    KD_RETURN_IF_ERROR(ValidateAdasum(q, size, what));
  }
  if (q.device >= 0 && !have_device_backend) {
    return Status::InvalidArgument(
        what() +
        ": the tensor is in GPU memory, but this "
        "kerasdist build has no GPU backend (rebuild "
        "with KERASDIST_WITH_NCCL=1).");
  }
  return Status::OK();
}

}  // namespace kerasdist::core
