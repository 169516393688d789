// What a framework front end (the TF GPU kernels) needs from CUDA, without
// including CUDA (or MPI) headers itself: registered by device_hooks.cc in
// builds with the GPU backend. `stream` is the framework's cudaStream_t on
// CUDA device `device`; the calling thread's current device may be another
// one (it is restored).
#ifndef KERASDIST_CORE_BACKENDS_GPU_DEVICE_HOOKS_H_
#define KERASDIST_CORE_BACKENDS_GPU_DEVICE_HOOKS_H_

#include "../../status.h"

namespace kerasdist::core {

struct DeviceStreamHooks {
  // Records a (pooled) event on `stream`: the Entry's ready_event.
  Status (*record_event)(void* stream, int device, void** event) = nullptr;
  // Returns an event from record_event to the pool once the entry is done.
  void (*release_event)(void* event, int device) = nullptr;
  // Blocks the calling thread until `stream` has finished its queued work.
  Status (*sync_stream)(void* stream, int device) = nullptr;
};

// The process's registration slot (one per library: an inline function's
// static is shared by every translation unit).
inline DeviceStreamHooks& RegisteredDeviceHooks() {
  static DeviceStreamHooks hooks;
  return hooks;
}

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_GPU_DEVICE_HOOKS_H_
