// The factories of the backends over a Communicator (communicator_backend.h):
// the job's transport (MPI, or TCP where kd.init() formed a TCP job, named
// so), the last resort for every host collective, and the one-rank
// allreduce.
#include "backends.h"
#include "communicator_backend.h"

namespace kerasdist::core {

Status MakeMpiBackend(const Config&, const NodeContext& ctx,
                      std::unique_ptr<Backend>* out) {
  const char* name = ctx.comm->Name() == "tcp" ? "tcp" : "mpi";
  *out =
      std::make_unique<CommunicatorBackend>(name, ctx.comm, ctx.comm->rank());
  return Status::OK();
}

Status MakeSelfBackend(const Config&, const NodeContext& ctx,
                       std::unique_ptr<Backend>* out) {
  *out = std::make_unique<SelfBackend>(ctx.comm->size());
  return Status::OK();
}

}  // namespace kerasdist::core
