// CUDA for framework front ends (DeviceStreamHooks, ops/core/device_hooks.h):
// events recorded on the framework's stream, and stream synchronisation.
// Compiled only with KERASDIST_WITH_NCCL; its last lines register the hooks.
#include <map>
#include <mutex>
#include <vector>

#include "../../device_hooks.h"
#include "gpu_util.h"
#include "on_device.h"

namespace kerasdist::core {

namespace {

// Events for front ends (DeviceStreamHooks): any thread may record or
// release one, so the pools (one per device: an event belongs to the device
// it was made on) have their own lock.
std::mutex front_events_mu;
std::map<int, std::vector<cudaEvent_t>> front_events;

Status RecordFrontEvent(void* stream, int device, void** event) {
  OnDevice on(device);
  KD_CHECK_CUDA(on.status());
  cudaEvent_t e = nullptr;
  {
    std::lock_guard<std::mutex> l(front_events_mu);
    std::vector<cudaEvent_t>& pool = front_events[device];
    if (!pool.empty()) {
      e = pool.back();
      pool.pop_back();
    }
  }
  if (e == nullptr)
    KD_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaError_t r = cudaEventRecord(e, static_cast<cudaStream_t>(stream));
  if (r != cudaSuccess) {
    cudaEventDestroy(e);
    return CudaError(r, "cudaEventRecord(event, framework stream)", __FILE__,
                     __LINE__);
  }
  *event = e;
  return Status::OK();
}

void ReleaseFrontEvent(void* event, int device) {
  if (event == nullptr) return;
  std::lock_guard<std::mutex> l(front_events_mu);
  front_events[device].push_back(static_cast<cudaEvent_t>(event));
}

Status SyncFrontStream(void* stream, int device) {
  OnDevice on(device);
  KD_CHECK_CUDA(on.status());
  KD_CHECK_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return Status::OK();
}

[[maybe_unused]] const bool kHooksRegistered = [] {
  RegisteredDeviceHooks() = {&RecordFrontEvent, &ReleaseFrontEvent,
                             &SyncFrontStream};
  return true;
}();

}  // namespace

}  // namespace kerasdist::core
