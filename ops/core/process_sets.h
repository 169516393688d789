// The process's runtimes: the job's (process set 0), started by init, and
// one per process set this rank is a member of (Horovod's process_set.h).
// A process set is a subset of the job's ranks whose collectives run on a
// runtime of its own: its own communicator, negotiation, fusion and response
// cache. Adding and removing sets is collective over every rank of the job.
// The job's runtime is the core's one mutable global; the C API (c_api.cc,
// enqueue.cc) reaches it only through these functions.
#ifndef KERASDIST_CORE_PROCESS_SETS_H_
#define KERASDIST_CORE_PROCESS_SETS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime.h"

namespace kerasdist::core {

// Starts the job's runtime with `settings` ("KERASDIST_X=value" lines over
// the environment) on the communicator of Fortran handle `comm_f` (when
// `has_comm`) or MPI_COMM_WORLD. OK at once while one runs; one stopped by
// another rank's shutdown is replaced.
Status StartJob(const char* settings, bool has_comm, int comm_f);
// Stops every set's runtime, then the job's; their pending collectives fail.
void StopJob();

// The job's runtime; nullptr when not initialized.
std::shared_ptr<Runtime> CurrentRuntime();

// The runtime of process set `id` (0: the job's) for request `q`, whose
// broadcast root_rank (a rank of the job) becomes the set's rank of it. An
// error for an unknown set, a set this rank is not in, a root outside the
// set, or before init.
Status RuntimeForSet(int id, Request* q, std::shared_ptr<Runtime>* out);

// `ranks`: sorted, distinct ranks of the job, neither the whole job nor an
// existing set's. Collective over the job; *id is the new set's (> 0).
Status AddProcessSet(const std::vector<int32_t>& ranks, int32_t* id);
// Collective over the job: stops set `id`'s runtime.
Status RemoveProcessSet(int32_t id);

// The ids of every set, 0 first; false before init.
bool ProcessSetIds(std::vector<int32_t>* ids);
// The job ranks of set `id`; an error before init or for an unknown id.
Status ProcessSetRanks(int32_t id, std::vector<int32_t>* ranks);
// This process's rank within set `id`: -1 when it is not a member, -2 for
// an unknown id or before init.
int ProcessSetRank(int32_t id);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_PROCESS_SETS_H_
