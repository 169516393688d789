// Checks of a request against this rank's own facts, before it is queued:
// pure functions, so that every rule is unit-testable without a runtime.
// (What ranks disagree about is checked by the coordinator: message.h's
// BuildResponse.)
#ifndef KERASDIST_CORE_VALIDATE_H_
#define KERASDIST_CORE_VALIDATE_H_

#include "message.h"
#include "status.h"

namespace kerasdist::core {

// Fills what a request implies (alltoall without splits: equal splits),
// then validates it. `size`: ranks in the job; `have_device_backend`: this
// build can run GPU tensors.
Status PrepareRequest(Request& q, int size, bool have_device_backend);

// The request as given: a name, a reducible dtype, a root in range,
// non-negative dimensions, finite scale factors, splits that add up.
Status ValidateRequest(const Request& q, int size, bool have_device_backend);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_VALIDATE_H_
