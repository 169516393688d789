// The process's one runtime, for the core's own entry points (the C API,
// c_api.cc, and the TF kernels' seam, frontend.cc); nullptr when not
// initialized.
#ifndef KERASDIST_CORE_GLOBAL_H_
#define KERASDIST_CORE_GLOBAL_H_

#include <memory>

#include "runtime.h"

namespace kerasdist::core {

std::shared_ptr<Runtime> CurrentRuntime();

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_GLOBAL_H_
