// MPI ownership: the communicator kerasdist duplicates for itself, the
// topology (local/cross ranks), the control channel used for negotiation and
// the MPI data-plane communicator.
#ifndef KERASDIST_CORE_TRANSPORT_MPI_CONTEXT_H_
#define KERASDIST_CORE_TRANSPORT_MPI_CONTEXT_H_

#ifdef KERASDIST_NO_MPI  // ops/Makefile: a source in CORE_PLAIN_SRCS
#error "this source sees mpi.h: list it in ops/Makefile's CORE_MPI_SRCS"
#endif
#include <mpi.h>
// Open MPI's fault-tolerance extension (ULFM: MPIX_Comm_revoke and
// MPIX_Comm_shrink), where the MPI built against has it. MPICH builds never
// see it: their path is what it was.
#if defined(OPEN_MPI) && defined(__has_include)
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#endif
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && defined(MPIX_ERR_PROC_FAILED)
#define KERASDIST_ULFM 1
#endif

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../control/liveness.h"
#include "job_transport.h"

namespace kerasdist::core {

class MpiContext : public JobTransport {
 public:
  // `parent_f` is a Fortran handle of the communicator to use (mpi4py's
  // comm.py2f()) when `has_parent`, else MPI_COMM_WORLD. (Handles can be
  // negative ints, so no value of `parent_f` can mean "none".) Initialises
  // MPI if nobody has.
  static Status Create(bool has_parent, int parent_f,
                       std::unique_ptr<MpiContext>* out);
  ~MpiContext() override;

  std::string Name() const override { return "mpi"; }
  const Topology& topology() const override { return topo_; }
  MPI_Comm comm() const { return comm_; }

  // Control plane: small negotiation messages, never blocking the caller.
  Status SendControl(int dest, std::string bytes) override;
  Status PollControl(bool* got, int* src, std::string* bytes) override;
  Status ProgressSends() override;
  // Waits (bounded) for this rank's control sends to leave, at shutdown.
  void FlushSends(double timeout_s) override;

  // MPI's collectives over the runtime's ranks, this node's among them
  // and one leader per node. The context keeps their MPI communicators.
  void MakeCommunicators(std::unique_ptr<Communicator>* all,
                         std::unique_ptr<Communicator>* node,
                         std::unique_ptr<Communicator>* leaders) override;

  // Recovery in place (mpi_recovery.cc). Revoke: every pending and later
  // call on this context's communicators fails, on every rank, with
  // Status::RanksLost (thread-safe: the heartbeat's thread calls it too).
  // Reform: collective over the survivors, from the runtime's thread once it
  // has stopped: revokes, then shrinks the job's communicator to the ranks
  // still alive, which the next kd.init() starts from (JobWorld). A shrink
  // that fails, or takes longer than `deadline_s` (another rank lost or
  // frozen meanwhile), ends this process with one line: the launcher then
  // relaunches from the last commit on disk, as without recovery.
  void Revoke() override;
  void Reform(double deadline_s) override;

 private:
  MpiContext() = default;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm node_comm_ = MPI_COMM_NULL, leader_comm_ = MPI_COMM_NULL;
  int control_tag_ = 0;
  Topology topo_;
  struct Pending {
    std::string bytes;
    MPI_Request request;
  };
  std::deque<Pending> sends_;
  std::atomic<bool> revoked_{false};  // its communicators are not freed
};

// Recovery in place is on: KERASDIST_RECOVER_IN_PLACE=1 (kerasdist run
// --recover-in-place sets it) on an MPI with ULFM whose job started with
// fault tolerance on (Open MPI's mpirun --with-ft ulfm). CheckRecovery, in
// Create once MPI runs: an error naming what is missing when it was asked
// for and cannot be had.
Status CheckRecovery();
bool RecoveryOn();
// The communicator a runtime starts from when kd.init() is given none:
// MPI_COMM_WORLD, or the survivors' after a recovery.
MPI_Comm JobWorld();
// How many times this process's job was re-formed in place.
int Recoveries();
// The job's communicator from now on (mpi_grow.cc, after growing).
void SetJobWorld(MPI_Comm comm);
// Ends this process (exit code 75) with one line unless destroyed within
// `seconds`: for the calls of recovery and growing that have no deadline
// of their own. The line: `what` " within N s" `why`.
class ReformWatch {
 public:
  ReformWatch(double seconds, int rank, std::string what, std::string why);
  ~ReformWatch();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool disarmed_ = false;
  std::thread thread_;
};

// Growing in place (mpi_grow.cc; docs/failures-and-elastic.md, "Growing in
// place"), with recovery in place on. GrowJob: collective over the job's
// communicator while no runtime runs: rank 0 starts `argvs.size()` new
// processes (MPI_Comm_spawn_multiple; each argv's first word is the
// program; `hosts[i]`: its spawn info, "key=value" lines such as
// "host=h") and every rank merges
// them into the job's communicator (the new ranks last, in order), which
// the next kd.init() starts from. The other ranks' arguments are unused.
// A failed start (MPI's error) leaves the job as it was; one that takes
// longer than `deadline_s` ends this process with one line.
Status GrowJob(const std::vector<std::vector<std::string>>& argvs,
               const std::vector<std::string>& hosts, double deadline_s);
// In a process GrowJob started (KERASDIST_GROWN_RANK set), under recovery
// in place: merges with the job that started it, whose communicator
// JobWorld() is from then on. Nothing elsewhere. In Create, after
// CheckRecovery.
Status JoinParents();
// How many times this process's job grew in place (its joining counts, in a
// process GrowJob started).
int Grows();
// Shrinking in place (mpi_grow.cc), with recovery in place on: collective
// over the job's communicator while no runtime runs. The ranks with
// `leave` leave the job (LeftJob() is true from then on: this process
// runs no runtime again, and ends without MPI_Finalize, whose agreement
// under ULFM would wait for the others' end); the others'
// next kd.init() starts from a communicator of theirs (MPI_Comm_split,
// in their order). MPI's error where the split fails; one that takes
// longer than `deadline_s` ends this process with one line.
Status ShrinkJob(bool leave, double deadline_s);
// How many times this process's job shrank in place (this rank staying).
int Shrinks();
bool LeftJob();

// The start-up window before the heartbeat runs (mpi_liveness.cc): kd.init()'s
// first collectives would wait for ever for a rank that froze or went right
// after MPI_Init. StartupCheckIn: every rank tells rank 0 it has arrived
// (point-to-point, polled), and rank 0 answers; a rank missing after
// KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS is named, and every rank ends with
// one line. StartStartupWatch then arms a deadline as long for the rest of
// the start (MPI_Comm_dup, the node split, the heartbeat's own exchange);
// EndStartupWatch, once the heartbeat runs, disarms it.
Status StartupCheckIn(MPI_Comm comm);
// kd.init() failed after MPI_Init on a job of more than one rank: the
// process ends without MPI_Finalize (whose barrier the others, waiting
// inside MPI for this rank, would never reach).
void SkipFinalizeAtExit();
void StartStartupWatch(MPI_Comm comm);
void EndStartupWatch();

// Turns an MPI error code into a Status naming the call.
Status MpiStatus(int code, const char* call);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_MPI_CONTEXT_H_
