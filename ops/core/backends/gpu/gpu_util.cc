// Compiled by nvcc as CUDA (-x cu): it holds the one kernel of the core.
#include "gpu_util.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace kerasdist::core {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond this

template <typename T>
__global__ void ScaleFloatKernel(T* dst, const T* src, int64_t n, T f) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    dst[i] = src[i] * f;
  }
}

// fp16 and bf16 scale in float, like the CPU path, so results match bit for
// bit.
template <typename T>
__global__ void Scale16Kernel(T* dst, const T* src, int64_t n, float f) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    dst[i] = static_cast<T>(static_cast<float>(src[i]) * f);
  }
}

// As the CPU path (scale.cc): with f 1 C's division by div, else
// src * f / div in double truncated toward zero (saturating beyond int64).
template <typename T>
__global__ void ScaleIntKernel(T* dst, const T* src, int64_t n, double f,
                               int64_t div) {
  const double g = div > 1 ? f / static_cast<double>(div) : f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    if (f == 1.0) {
      dst[i] = static_cast<T>(static_cast<int64_t>(src[i]) / div);
      continue;
    }
    const double x = static_cast<double>(src[i]) * g;
    int64_t v;
    if (x >= 9223372036854775807.0) {
      v = INT64_MAX;
    } else if (x <= -9223372036854775807.0) {
      v = INT64_MIN;
    } else {
      v = static_cast<int64_t>(x);
    }
    dst[i] = static_cast<T>(v);
  }
}

int Blocks(int64_t n) {
  return static_cast<int>(
      std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

template <typename T>
void LaunchScaleInt(void* dst, const void* src, int64_t n, double f,
                    int64_t div, cudaStream_t stream) {
  ScaleIntKernel<<<Blocks(n), kThreads, 0, stream>>>(
      static_cast<T*>(dst), static_cast<const T*>(src), n, f, div);
}

}  // namespace

Status CudaError(cudaError_t e, const char* call, const char* file, int line) {
  return Status::Internal(std::string("CUDA error in ") + file + ":" +
                          std::to_string(line) + ": " + call + ": " +
                          cudaGetErrorString(e) + " (CUDA runtime " +
                          CudaRuntimeVersion() + ")");
}

std::string CudaRuntimeVersion() {
  return std::to_string(CUDART_VERSION / 1000) + "." +
         std::to_string(CUDART_VERSION % 1000 / 10);
}

Status ScaleCopyAsync(void* dst, const void* src, int64_t n, DataType dt,
                      double factor, int64_t int_divisor, cudaStream_t stream) {
  if (n <= 0) return Status::OK();
  const bool is_int = !IsFloating(dt);
  if (factor == 1.0 && (!is_int || int_divisor <= 1)) {
    if (dst != src) {
      KD_CHECK_CUDA(cudaMemcpyAsync(dst, src, n * DataTypeSize(dt),
                                    cudaMemcpyDeviceToDevice, stream));
    }
    return Status::OK();
  }
  const int b = Blocks(n);
  switch (dt) {
    case DataType::kFloat32:
      ScaleFloatKernel<<<b, kThreads, 0, stream>>>(
          static_cast<float*>(dst), static_cast<const float*>(src), n,
          static_cast<float>(factor));
      break;
    case DataType::kFloat64:
      ScaleFloatKernel<<<b, kThreads, 0, stream>>>(
          static_cast<double*>(dst), static_cast<const double*>(src), n,
          factor);
      break;
    case DataType::kFloat16:
      Scale16Kernel<<<b, kThreads, 0, stream>>>(static_cast<__half*>(dst),
                                                static_cast<const __half*>(src),
                                                n, static_cast<float>(factor));
      break;
    case DataType::kBFloat16:
      Scale16Kernel<<<b, kThreads, 0, stream>>>(
          static_cast<__nv_bfloat16*>(dst),
          static_cast<const __nv_bfloat16*>(src), n,
          static_cast<float>(factor));
      break;
    case DataType::kInt32:
      LaunchScaleInt<int32_t>(dst, src, n, factor, int_divisor, stream);
      break;
    case DataType::kInt64:
      LaunchScaleInt<int64_t>(dst, src, n, factor, int_divisor, stream);
      break;
    case DataType::kUInt8:
    case DataType::kBool:
      LaunchScaleInt<uint8_t>(dst, src, n, factor, int_divisor, stream);
      break;
    case DataType::kInt8:
      LaunchScaleInt<int8_t>(dst, src, n, factor, int_divisor, stream);
      break;
    case DataType::kInt16:
      LaunchScaleInt<int16_t>(dst, src, n, factor, int_divisor, stream);
      break;
    case DataType::kUInt16:
      LaunchScaleInt<uint16_t>(dst, src, n, factor, int_divisor, stream);
      break;
  }
  KD_CHECK_CUDA(cudaGetLastError());
  return Status::OK();
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFreeAsync(data_, stream_);
}

Status DeviceBuffer::Reserve(int64_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_ && stream == stream_) return Status::OK();
  if (data_) KD_CHECK_CUDA(cudaFreeAsync(data_, stream_));
  data_ = nullptr;
  bytes_ = 0;
  stream_ = stream;
  // Round up so that a slowly growing batch does not reallocate every step.
  const int64_t want = std::max<int64_t>(bytes, 1) + (bytes >> 3);
  KD_CHECK_CUDA(cudaMallocAsync(&data_, want, stream));
  bytes_ = want;
  return Status::OK();
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) cudaFreeHost(data_);
}

Status PinnedBuffer::Reserve(int64_t bytes) {
  if (bytes <= bytes_) return Status::OK();
  if (data_) KD_CHECK_CUDA(cudaFreeHost(data_));
  data_ = nullptr;
  bytes_ = 0;
  const int64_t want = std::max<int64_t>(bytes, 1) + (bytes >> 3);
  KD_CHECK_CUDA(cudaMallocHost(&data_, want));
  bytes_ = want;
  return Status::OK();
}

EventPool::~EventPool() {
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
}

Status EventPool::Get(cudaEvent_t* event) {
  if (!free_.empty()) {
    *event = free_.back();
    free_.pop_back();
    return Status::OK();
  }
  KD_CHECK_CUDA(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
  return Status::OK();
}

}  // namespace kerasdist::core
