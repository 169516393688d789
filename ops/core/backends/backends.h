// The runtime's ordered list of backends (backends.cc), and what a backend's
// factory is given.
//
// To add a backend: write one file with a class implementing Backend
// (backend.h) and a factory (BackendFactory below), and add one line for it
// to the list in backends.cc, before the backends it should win over. Its
// settings, if it has any, are a row each in config.cc's table
// (Setting::Int or Setting::Flag: no Config member), read by name
// (config.Int("KERASDIST_...")). The runtime counts the batches every
// backend runs, by name (kerasdist_backend_runs). docs/architecture.md,
// "Adding a backend", walks through one with its thread test.
//
// A factory that finds its backend unusable here (the ranks do not share a
// node, a setting is off, a probe failed) leaves *out null and returns OK.
// Factories run on every rank in the list's order and may be collective over
// ctx.comm (agreeing with the other ranks is how they decide alike).
//
// Backends see their ranks only through Communicators (no MPI here), so the
// core's tests run them with ranks as threads (ops/tests/).
#ifndef KERASDIST_CORE_BACKENDS_BACKENDS_H_
#define KERASDIST_CORE_BACKENDS_BACKENDS_H_

#include <memory>

#include "../config.h"
#include "../transport/communicator.h"
#include "backend.h"

namespace kerasdist::core {

// Where a list of backends runs. The communicators outlive the list.
struct NodeContext {
  Communicator* comm = nullptr;  // the ranks the list serves (MPI over them)
  // This node's ranks of `comm` (their order kept; node rank 0 leads the
  // node), and one leader per node in node order (null on the others).
  Communicator* node = nullptr;
  Communicator* leaders = nullptr;
  // The list's last entry, the last resort, made first: it runs whatever
  // another backend hands on (shm: a batch the ranks could not get slots for).
  Backend* fallback = nullptr;
  // The node-level list of the hierarchical backend (its ranks share one
  // host; no device tensors reach it): the backends that compose across
  // hosts or take device tensors are left out.
  bool within_node = false;

  // `node` when it holds every rank of `comm` and there are two or more,
  // else null: the same answer on every rank (the single-node backends).
  Communicator* one_node() const {
    return comm->size() >= 2 && node->size() == comm->size() ? node : nullptr;
  }
};

// A backend's factory (its file defines it; backends.cc lists it).
using BackendFactory = Status(const Config& config, const NodeContext& ctx,
                              std::unique_ptr<Backend>* out);

// Makes the list over `ctx` (ctx.fallback is filled in here), in the order a
// batch tries them. Collective over ctx.comm.
Status MakeBackends(const Config& config, const NodeContext& ctx,
                    BackendList* out);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_BACKENDS_H_
