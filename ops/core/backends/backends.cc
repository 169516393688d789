#include "backends.h"

namespace kerasdist::core {

// The list, one line a backend, in the order a batch tries them: the first
// enabled one runs it. The last line is the last resort (every host
// collective), which the others may hand a batch to.
#define KERASDIST_BACKENDS(X)                                               \
  X(MakeDeviceBackend)       /* GPU tensors: NCCL, or staged (gpu/) */      \
  X(MakeSelfBackend)         /* one rank: only the scaling */               \
  X(MakeAdasumBackend)       /* op=Adasum: the halving-doubling tree */     \
  X(MakeCmaBackend)          /* one node: peers read each other in place */ \
  X(MakeShmBackend)          /* one node: shared-memory slots */            \
  X(MakeHierarchicalBackend) /* several hosts: within, across, within */    \
  X(MakeMpiBackend)          /* everything else */

#define KERASDIST_DECLARE_FACTORY(make) BackendFactory make;
KERASDIST_BACKENDS(KERASDIST_DECLARE_FACTORY)
#define KERASDIST_LIST_FACTORY(make) &make,
static BackendFactory* const kFactories[] = {
    KERASDIST_BACKENDS(KERASDIST_LIST_FACTORY)};
#undef KERASDIST_LIST_FACTORY
#undef KERASDIST_DECLARE_FACTORY
#undef KERASDIST_BACKENDS

Status MakeBackends(const Config& config, const NodeContext& ctx,
                    BackendList* out) {
  out->clear();
  constexpr size_t n = sizeof(kFactories) / sizeof(kFactories[0]);
  // The last resort first, so that the others can fall back to it.
  std::unique_ptr<Backend> last;
  KD_RETURN_IF_ERROR(kFactories[n - 1](config, ctx, &last));
  if (!last)
    return Status::Internal(
        "the last backend of the list made none (kerasdist bug)");
  NodeContext c = ctx;
  c.fallback = last.get();
  for (size_t i = 0; i + 1 < n; ++i) {
    std::unique_ptr<Backend> b;
    KD_RETURN_IF_ERROR(kFactories[i](config, c, &b));
    if (b) out->push_back(std::move(b));
  }
  out->push_back(std::move(last));
  return Status::OK();
}

}  // namespace kerasdist::core
