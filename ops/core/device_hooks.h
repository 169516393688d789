// What a framework front end (the TF GPU kernels) needs from CUDA beside the
// C API (c_api.h), without including CUDA (or MPI) headers itself: events
// on the framework's stream for kerasdist_tensor's ready_event, and stream
// synchronisation. backends/gpu/device_hooks.cc registers them in builds
// with the GPU backend. `stream` is the framework's cudaStream_t on CUDA
// device `device`; the calling thread's current device may be another one
// (it is restored).
#ifndef KERASDIST_CORE_DEVICE_HOOKS_H_
#define KERASDIST_CORE_DEVICE_HOOKS_H_

#include "status.h"

namespace kerasdist::core {

struct DeviceStreamHooks {
  // Records a (pooled) event on `stream`: a tensor's ready_event.
  Status (*record_event)(void* stream, int device, void** event) = nullptr;
  // Returns an event from record_event to the pool once the tensor is done.
  void (*release_event)(void* event, int device) = nullptr;
  // Blocks the calling thread until `stream` has finished its queued work.
  Status (*sync_stream)(void* stream, int device) = nullptr;
};

// The process's registration slot, in libkerasdist_core (one for every
// library that links it).
DeviceStreamHooks& RegisteredDeviceHooks();

// The registered hooks, or null in a build without the GPU backend.
const DeviceStreamHooks* DeviceHooks();

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_DEVICE_HOOKS_H_
