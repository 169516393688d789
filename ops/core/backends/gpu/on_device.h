// OnDevice: makes a CUDA device current on this thread for its lifetime,
// then restores the thread's previous one (a framework's or XLA's thread may
// expect its own). Header-only, CUDA's runtime API alone: the core's device
// hooks and JAX's CUDA handlers (ops/jax/ffi_cuda.cc) share it.
#ifndef KERASDIST_CORE_BACKENDS_GPU_ON_DEVICE_H_
#define KERASDIST_CORE_BACKENDS_GPU_ON_DEVICE_H_

#include <cuda_runtime_api.h>

namespace kerasdist::core {

class OnDevice {
 public:
  explicit OnDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
  }
  ~OnDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
  // cudaSuccess, or why the device could not be made current.
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_GPU_ON_DEVICE_H_
