// The process's one runtime, for front ends compiled against the core (the
// TF kernels); nullptr when not initialized.
#ifndef KERASDIST_CORE_GLOBAL_H_
#define KERASDIST_CORE_GLOBAL_H_

#include <memory>

#include "runtime.h"

namespace kerasdist::core {

std::shared_ptr<Runtime> CurrentRuntime();

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_GLOBAL_H_
