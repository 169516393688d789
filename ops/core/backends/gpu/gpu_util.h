// CUDA helpers of the GPU data path: the check macro, stream-ordered device
// buffers, pinned host buffers, an event pool and the scaling kernel.
// Compiled only with KERASDIST_WITH_NCCL (gpu_util.cc goes through nvcc); only
// backends/gpu/'s NCCL and CUDA files (Makefile: GPU_SRCS) include CUDA
// headers.
#ifndef KERASDIST_CORE_BACKENDS_GPU_GPU_UTIL_H_
#define KERASDIST_CORE_BACKENDS_GPU_GPU_UTIL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../../status.h"
#include "../../types.h"

namespace kerasdist::core {

// "CUDA error in core/backends/gpu/x.cc:42: cudaMemcpyAsync(...): invalid
// argument (CUDA runtime 13.0)".
Status CudaError(cudaError_t e, const char* call, const char* file, int line);

#define KD_CHECK_CUDA(expr)                                                  \
  do {                                                                       \
    cudaError_t _kd_e = (expr);                                              \
    if (_kd_e != cudaSuccess)                                                \
      return ::kerasdist::core::CudaError(_kd_e, #expr, __FILE__, __LINE__); \
  } while (0)

// "13.0": the CUDA runtime this library was compiled against.
std::string CudaRuntimeVersion();

// dst[i] = src[i] * factor on `stream`, with the exact semantics of
// ScaleCopy (scale.h): integers are first divided by `int_divisor`
// (truncating), then scaled and rounded to nearest. Without scaling it is a
// plain D2D copy (or nothing when dst == src). dst may equal src.
Status ScaleCopyAsync(void* dst, const void* src, int64_t count, DataType dt,
                      double factor, int64_t int_divisor, cudaStream_t stream);

// A grow-only device buffer whose memory is stream-ordered: growing frees the
// old block with cudaFreeAsync on the same stream, so work already queued on
// that stream keeps a valid pointer and nothing waits for the device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
  Status Reserve(int64_t bytes, cudaStream_t stream);
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
};

// Page-locked host memory for the host-staged (KERASDIST_GPU_OPERATIONS=MPI)
// path; grows only, and only while the stream using it is idle.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();
  Status Reserve(int64_t bytes);
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
};

// Timing-free events, reused: creating one per batch costs microseconds.
class EventPool {
 public:
  EventPool() = default;
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool();
  Status Get(cudaEvent_t* event);
  void Put(cudaEvent_t event) { free_.push_back(event); }

 private:
  std::vector<cudaEvent_t> free_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_GPU_GPU_UTIL_H_
