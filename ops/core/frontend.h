// The seam between the TF kernels and the core: queue entries, reach CUDA
// through hooks. (JAX's FFI handlers and the PyTorch ops reach the core
// through its C API, c_api.h.) Nothing here
// includes MPI or the runtime's internals, so a front end compiles without
// MPI flags and sees none of the core's headers beyond these few.
#ifndef KERASDIST_CORE_FRONTEND_H_
#define KERASDIST_CORE_FRONTEND_H_

#include <memory>
#include <vector>

#include "backends/gpu/device_hooks.h"
#include "entry.h"
#include "host_buffer.h"
#include "status.h"

namespace kerasdist::core {

class Runtime;

// The process's runtime as a front end holds it while it queues: keeps it
// alive for the call even if another thread shuts kerasdist down.
class RuntimeRef {
 public:
  // Empty (false) when kerasdist is not initialized. Enqueue routes to
  // process set `process_set`'s runtime (global.h's RuntimeForSet: an error
  // there fails the enqueue).
  static RuntimeRef Current(int process_set = 0);
  explicit operator bool() const { return rt_ != nullptr; }
  // As Runtime::Enqueue / EnqueueMany (runtime.h).
  Status Enqueue(Entry entry);
  Status EnqueueMany(std::vector<Entry>& entries, size_t* queued);

 private:
  std::shared_ptr<Runtime> rt_;
  int process_set_ = 0;
};

// The CUDA hooks, or null in a build without the GPU backend.
const DeviceStreamHooks* DeviceHooks();

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_FRONTEND_H_
