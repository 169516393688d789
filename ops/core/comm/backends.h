// The runtime's ordered list of backends, and the factory of each one.
//
// To add a transport: write one file with a class implementing Backend
// (backend.h) and a factory below, and list it in MakeBackends
// (backends.cc), before the backends it should win over. A factory
// that finds its transport unusable here (the ranks do not share a node, a
// probe failed) sets *out to null and returns OK; it is collective over
// `comm` when it needs to agree with the other ranks.
#ifndef KERASDIST_CORE_COMM_BACKENDS_H_
#define KERASDIST_CORE_COMM_BACKENDS_H_

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "communicator.h"

namespace kerasdist::core {

// What the backends need to know, filled by the runtime from its Config.
struct BackendOptions {
  MPI_Comm comm = MPI_COMM_NULL;  // the runtime's own communicator
  int rank = 0, size = 1;
  Communicator* host = nullptr;   // the MPI data plane (outlives the list)
  bool shm = true;                // KERASDIST_SHM_ALLREDUCE
  int64_t shm_min_bytes = 0;      // KERASDIST_SHM_ALLREDUCE_MIN_BYTES
  bool cma = true;                // KERASDIST_CMA_ALLREDUCE
  int64_t cma_min_tensor_bytes = 0;  // KERASDIST_CMA_MIN_TENSOR_BYTES
  bool gpu_host_staged = false;   // KERASDIST_GPU_OPERATIONS=MPI
  // KERASDIST_HIERARCHICAL_ALLREDUCE: 0 off, 1 on where the job spans hosts
  // with several ranks on some host; and the smallest batch it takes.
  bool hierarchical = true;
  bool hierarchical_allgather = true;  // KERASDIST_HIERARCHICAL_ALLGATHER
  int64_t hierarchical_min_bytes = 0;
};

// The list, in the order batches try them. Collective over o.comm.
Status MakeBackends(const BackendOptions& o, BackendList* out);

// The single-node backends, `cma` before `shm`, appended to `list` where
// the ranks of o.comm share one node (collective over o.comm); `fallback`
// runs what the slots cannot hold.
Status AddSingleNodeBackends(const BackendOptions& o, Backend* fallback,
                             BackendList* list);

// Factories (each in its backend's file).
// GPU tensors: NCCL, or staged through host memory (device_backend.cc).
Status MakeDeviceBackend(const BackendOptions& o, std::unique_ptr<Backend>* out);
// Several hosts, several ranks on some host: within each host over its node
// path, across hosts among one leader per host, then back within each host
// (hierarchical_backend.cc).
Status MakeHierarchicalBackend(const BackendOptions& o, std::unique_ptr<Backend>* out);
// Single node, staged in shared-memory slots; `fallback` runs a batch the
// ranks could not get slots for. *agreed_min_bytes: the smallest allreduce
// it takes, agreed by the ranks (shm_backend.cc).
Status MakeShmBackend(const BackendOptions& o, Backend* fallback,
                      std::unique_ptr<Backend>* out, int64_t* agreed_min_bytes);
// Single node, in place: peers read each other's memory. Only beside the
// shm backend, for the allreduces it would take (o.shm_min_bytes: as
// agreed there) whose tensors are not too small (cma_backend.cc).
Status MakeCmaBackend(const BackendOptions& o, std::unique_ptr<Backend>* out);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_COMM_BACKENDS_H_
