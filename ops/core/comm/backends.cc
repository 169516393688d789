#include "backends.h"

#include "communicator_backend.h"

namespace kerasdist::core {

Status MakeBackends(const BackendOptions& o, BackendList* out) {
  out->clear();
  // The last resort runs every host collective; the single-node paths fall
  // back to it.
  auto mpi = std::make_unique<CommunicatorBackend>("mpi", o.host, o.rank);
  std::unique_ptr<Backend> b;
  // First enabled wins. Each Make* may leave `b` null (not usable here).
  KD_RETURN_IF_ERROR(MakeDeviceBackend(o, &b));
  if (b) out->push_back(std::move(b));
  out->push_back(std::make_unique<SelfBackend>(o.size));
  KD_RETURN_IF_ERROR(AddSingleNodeBackends(o, mpi.get(), out));
  KD_RETURN_IF_ERROR(MakeHierarchicalBackend(o, &b));
  if (b) out->push_back(std::move(b));
  out->push_back(std::move(mpi));
  return Status::OK();
}

Status AddSingleNodeBackends(const BackendOptions& o, Backend* fallback,
                             BackendList* list) {
  std::unique_ptr<Backend> shm, cma;
  BackendOptions node = o;
  KD_RETURN_IF_ERROR(MakeShmBackend(o, fallback, &shm, &node.shm_min_bytes));
  if (!shm) return Status::OK();
  KD_RETURN_IF_ERROR(MakeCmaBackend(node, &cma));
  if (cma) list->push_back(std::move(cma));
  list->push_back(std::move(shm));
  return Status::OK();
}

}  // namespace kerasdist::core
