// The process's one runtime, for the core's own entry points (the C API,
// c_api.cc, and the TF kernels' seam, frontend.cc); nullptr when not
// initialized.
#ifndef KERASDIST_CORE_GLOBAL_H_
#define KERASDIST_CORE_GLOBAL_H_

#include <memory>

#include "runtime.h"

namespace kerasdist::core {

std::shared_ptr<Runtime> CurrentRuntime();

// The runtime of process set `id` (0: CurrentRuntime()) for request `q`,
// whose broadcast root_rank (a rank of the job) becomes the set's rank of
// it. An error for an unknown set, a set this rank is not in, a root
// outside the set, or before init.
Status RuntimeForSet(int id, Request* q, std::shared_ptr<Runtime>* out);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_GLOBAL_H_
