// The GPU data path as the runtime sees it. No CUDA here: the runtime asks
// RegisteredDeviceBackend() whether gpu_backend.cc (compiled only with
// KERASDIST_WITH_NCCL) has registered an implementation. Negotiation, the
// response cache and fusion planning stay on the host and on MPI exactly as
// for host tensors; only the execution of a batch whose tensors live in GPU
// memory comes here, through the Backend interface (backend.h), which this
// path implements asynchronously: Run queues the work on a communication
// stream, and Poll reports each batch once the device has finished it.
#ifndef KERASDIST_CORE_BACKENDS_GPU_DEVICE_BACKEND_H_
#define KERASDIST_CORE_BACKENDS_GPU_DEVICE_BACKEND_H_

#include <memory>
#include <string>

#include "../../transport/communicator.h"
#include "../backend.h"

namespace kerasdist::core {

struct DeviceBackendOptions {
  int rank = 0, size = 1;
  int device = 0;            // CUDA ordinal of this rank's tensors
  bool host_staged = false;  // KERASDIST_GPU_OPERATIONS=MPI
  // The MPI data plane over the runtime's ranks: host staging, and the set-up
  // (the NCCL id's broadcast, the agreement that every rank succeeded).
  Communicator* host = nullptr;
};

// Collective over o.host: every rank makes its backend at the same batch.
using DeviceBackendFactory = Status (*)(const DeviceBackendOptions&,
                                        std::unique_ptr<Backend>*);

struct DeviceBackendInfo {
  DeviceBackendFactory factory =
      nullptr;          // nullptr: built without a GPU backend
  std::string version;  // "NCCL 2.x.y, CUDA 13.0"
};

// The process's registration slot (one per library: an inline function's
// static is shared by every translation unit).
inline DeviceBackendInfo& RegisteredDeviceBackend() {
  static DeviceBackendInfo info;
  return info;
}

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_GPU_DEVICE_BACKEND_H_
