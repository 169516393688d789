// The runtime's ordered list of backends (backends.cc), and what a backend's
// factory is given.
//
// To add a backend: write one file with a class implementing Backend
// (backend.h) and a factory (BackendFactory below), and add one line for it
// to the list in backends.cc, before the backends it should win over. Its
// settings, if it has any, are Config members with a row each in config.cc's
// table. The runtime counts the batches every backend runs, by name
// (kerasdist_backend_runs).
//
// A factory that finds its backend unusable here (the ranks do not share a
// node, a setting is off, a probe failed) leaves *out null and returns OK.
// Factories run on every rank in the list's order and may be collective over
// ctx.comm (agreeing with the other ranks is how they decide alike).
#ifndef KERASDIST_CORE_BACKENDS_BACKENDS_H_
#define KERASDIST_CORE_BACKENDS_BACKENDS_H_

#ifdef KERASDIST_NO_MPI  // ops/Makefile: a source in CORE_PLAIN_SRCS
#error "this source sees mpi.h: list it in ops/Makefile's CORE_MPI_SRCS"
#endif
#include <mpi.h>

#include <memory>

#include "../config.h"
#include "../transport/communicator.h"
#include "backend.h"

namespace kerasdist::core {

// Where a list of backends runs.
struct NodeContext {
  MPI_Comm comm = MPI_COMM_NULL;       // the ranks the list serves
  int rank = 0, size = 1;              // in `comm`
  int local_rank = 0, local_size = 1;  // among the ranks of this node
  Communicator* host = nullptr;        // MPI over `comm` (outlives the list)
  // The list's last entry, the last resort, made first: it runs whatever
  // another backend hands on (shm: a batch the ranks could not get slots for).
  Backend* fallback = nullptr;
  // The node-level list of the hierarchical backend (its ranks share one
  // host; no device tensors reach it): the backends that compose across
  // hosts or take device tensors are left out.
  bool within_node = false;
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
