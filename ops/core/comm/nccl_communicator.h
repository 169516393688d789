// The GPU data path as the runtime sees it. This header has no CUDA in it:
// the runtime includes it in every build and asks RegisteredDeviceBackend()
// whether nccl_communicator.cc (compiled only with KERASDIST_WITH_NCCL) has
// registered an implementation. Negotiation, the response cache and fusion
// planning stay on the host and on MPI exactly as for host tensors; only the
// execution of a batch whose tensors live in GPU memory comes here.
#ifndef KERASDIST_CORE_COMM_NCCL_COMMUNICATOR_H_
#define KERASDIST_CORE_COMM_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mpi_context.h"

namespace kerasdist::core {

struct Entry;
struct Response;
struct Result;

struct DeviceBackendOptions {
  MPI_Comm comm = MPI_COMM_NULL;  // the runtime's communicator (NCCL id exchange)
  int rank = 0, size = 1;
  int device = 0;                 // CUDA ordinal of this rank's tensors
  bool host_staged = false;       // KERASDIST_GPU_OPERATIONS=MPI
  Communicator* host = nullptr;   // the MPI data plane, for host staging
};

using FinishedEntries = std::vector<std::pair<Entry, Result>>;

// Runs batches of device collectives asynchronously on one communication
// stream. Every rank calls Execute for the same batches in the coordinator's
// order (NCCL deadlocks otherwise). Execute returns once the work is queued on
// the stream; the entries come back through Poll when an event recorded after
// that work has completed, so the background thread never waits for the device.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual std::string Name() const = 0;
  // `entries[i]` belongs to `resps[i]`. An error is returned only for failures
  // that break the backend; collective-specific errors arrive via Poll.
  virtual Status Execute(const std::vector<const Response*>& resps,
                         std::vector<Entry> entries) = 0;
  // Moves entries whose work has finished into `out` (never blocks).
  virtual void Poll(FinishedEntries* out) = 0;
  // Waits up to `timeout_s` for everything in flight, then aborts the NCCL
  // communicator and fails what is left with `abort_status`.
  virtual void Drain(double timeout_s, const Status& abort_status,
                     FinishedEntries* out) = 0;
  virtual bool Busy() const = 0;
};

using DeviceBackendFactory = Status (*)(const DeviceBackendOptions&,
                                        std::unique_ptr<DeviceBackend>*);

// What a framework front end (the TF GPU kernels) needs from CUDA, without
// including CUDA headers itself. `stream` is the framework's cudaStream_t on
// CUDA device `device`; the calling thread's current device may be another
// one (it is restored).
struct DeviceStreamHooks {
  // Records a (pooled) event on `stream`: the Entry's ready_event.
  Status (*record_event)(void* stream, int device, void** event) = nullptr;
  // Returns an event from record_event to the pool once the entry is done.
  void (*release_event)(void* event, int device) = nullptr;
  // Blocks the calling thread until `stream` has finished its queued work.
  Status (*sync_stream)(void* stream, int device) = nullptr;
};

struct DeviceBackendInfo {
  DeviceBackendFactory factory = nullptr;  // nullptr: built without a GPU backend
  std::string version;                     // "NCCL 2.x.y, CUDA 13.0"
  DeviceStreamHooks hooks;
};

// The process's registration slot (one per library: an inline function's
// static is shared by every translation unit).
inline DeviceBackendInfo& RegisteredDeviceBackend() {
  static DeviceBackendInfo info;
  return info;
}

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_COMM_NCCL_COMMUNICATOR_H_
