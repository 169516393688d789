// The custom-call targets TensorFlow's XLA kernels (tf/xla_kernels.cc) emit
// and tf/xla_ffi.cc registers handlers for.
#ifndef KERASDIST_OPS_TF_XLA_TARGETS_H_
#define KERASDIST_OPS_TF_XLA_TARGETS_H_

namespace kerasdist::tf::xla_targets {

inline constexpr char kAllreduce[] = "kerasdist_allreduce";
inline constexpr char kGroupedAllreduce[] = "kerasdist_grouped_allreduce";
inline constexpr char kAllgather[] = "kerasdist_allgather";
inline constexpr char kBroadcast[] = "kerasdist_broadcast";
inline constexpr char kAlltoall[] = "kerasdist_alltoall";
inline constexpr char kReducescatter[] = "kerasdist_reducescatter";
inline constexpr char kBarrier[] = "kerasdist_barrier";

}  // namespace kerasdist::tf::xla_targets

#endif  // KERASDIST_OPS_TF_XLA_TARGETS_H_
