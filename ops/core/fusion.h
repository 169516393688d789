// Tensor Fusion planning as a pure function: which ready responses travel
// together in one fusion buffer.
#ifndef KERASDIST_CORE_FUSION_H_
#define KERASDIST_CORE_FUSION_H_

#include <cstdint>
#include <vector>

#include "message.h"

namespace kerasdist::core {

// Splits `ready` (in execution order) into batches. Allreduces without error
// that share dtype, reduction, scale factors and device are packed greedily,
// in order, into batches of at most `threshold_bytes` (a tensor larger than
// the threshold travels alone); everything else is a batch of one. Batches are
// ordered by their first member. Every rank executes this plan as is.
std::vector<std::vector<int>> PlanFusion(
    const std::vector<const Response*>& ready, int64_t threshold_bytes);
std::vector<std::vector<int>> PlanFusion(const std::vector<Response>& ready,
                                         int64_t threshold_bytes);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_FUSION_H_
