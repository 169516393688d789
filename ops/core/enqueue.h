// A front end's kerasdist_tensor (c_api.h) as the runtime's Entry
// (entry.h), and its enqueue: the C callbacks become the entry's `allocate`
// and `done`, and the request goes to its process set's runtime.
#ifndef KERASDIST_CORE_ENQUEUE_H_
#define KERASDIST_CORE_ENQUEUE_H_

#include <cstdint>

#include "c_api.h"
#include "status.h"

namespace kerasdist::core {

// Enqueues `n` tensors in order, under one lock (kerasdist_enqueue_tensors):
// *queued of them were queued and will be called back; the error, if any,
// is the first failure's.
Status EnqueueTensors(const kerasdist_tensor* t, int32_t n, int32_t* queued);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_ENQUEUE_H_
