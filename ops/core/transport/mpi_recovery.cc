// Recovery in place (mpi_context.h; docs/failures-and-elastic.md, "Recovery
// in place"): on an MPI with ULFM (Open MPI 5 under mpirun --with-ft ulfm),
// a lost rank makes the survivors' calls fail with Status::RanksLost; the
// runtime revokes its communicators, so that every survivor's pending and
// later calls fail the same way, and shrinks the job's communicator to the
// survivors, which the next kd.init() starts from. Built against an MPI
// without ULFM (the mpich wheel) all of it compiles to nothing but the
// check that says it cannot be had.
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "mpi_context.h"

namespace kerasdist::core {

namespace {

constexpr int kExitPeerLost = 75;  // as the heartbeat's (liveness.cc)
constexpr char kAskVariable[] = "KERASDIST_RECOVER_IN_PLACE";
constexpr char kGuide[] = "docs/failures-and-elastic.md, \"Recovery in place\"";

bool g_recovery = false;
MPI_Comm g_world = MPI_COMM_NULL;
int g_recoveries = 0;

bool Asked() {
  const char* text = std::getenv(kAskVariable);
  return text != nullptr && std::strcmp(text, "1") == 0;
}

[[noreturn]] void EndThisRank(int rank, const std::string& why) {
  std::fflush(nullptr);
  const std::string line = "kerasdist: rank " + std::to_string(rank) +
                           ": recovery in place failed: " + why +
                           "; ending this rank (a relaunch resumes from the "
                           "last commit on disk).\n";
  ssize_t ignored = write(2, line.data(), line.size());
  (void)ignored;
  _exit(kExitPeerLost);
}

}  // namespace

Status CheckRecovery() {
  g_recovery = false;
  if (!Asked()) return Status::OK();
#ifndef KERASDIST_ULFM
  return Status::Precondition(
      std::string(kAskVariable) +
      "=1 (kerasdist run --recover-in-place) needs an MPI with ULFM fault "
      "tolerance (Open MPI 5, started by mpirun --with-ft ulfm), but this "
      "kerasdist was built against an MPI without it; build it against Open "
      "MPI, or leave recovery in place off (" +
      kGuide + ").");
#else
  int* ft = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPIX_FT, &ft, &flag);
  if (!flag || ft == nullptr || *ft == 0) {
    return Status::Precondition(
        std::string(kAskVariable) +
        "=1, but this job's MPI started without fault tolerance: start it "
        "with kerasdist run --recover-in-place, or Open MPI's mpirun "
        "--with-ft ulfm (" +
        kGuide + ").");
  }
  g_recovery = true;
  return Status::OK();
#endif
}

bool RecoveryOn() { return g_recovery; }

MPI_Comm JobWorld() {
  return g_world != MPI_COMM_NULL ? g_world : MPI_COMM_WORLD;
}

int Recoveries() { return g_recoveries; }

void SetJobWorld(MPI_Comm comm) { g_world = comm; }

ReformWatch::ReformWatch(double seconds, int rank, std::string what,
                         std::string why) {
  thread_ = std::thread([this, seconds, rank, what, why] {
    std::unique_lock<std::mutex> l(mu_);
    const bool done = cv_.wait_for(l, std::chrono::duration<double>(seconds),
                                   [this] { return disarmed_; });
    if (!done) {
      EndThisRank(rank, what + " within " +
                            std::to_string(static_cast<int>(seconds)) + " s" +
                            why);
    }
  });
}

ReformWatch::~ReformWatch() {
  {
    std::lock_guard<std::mutex> l(mu_);
    disarmed_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void MpiContext::Revoke() {
#ifdef KERASDIST_ULFM
  if (!g_recovery) return;
  revoked_ = true;
  for (MPI_Comm c : {comm_, node_comm_, leader_comm_}) {
    if (c != MPI_COMM_NULL) MPIX_Comm_revoke(c);
  }
#endif
}

void MpiContext::Reform(double deadline_s) {
#ifdef KERASDIST_ULFM
  if (!g_recovery) return;
  Revoke();
  MPI_Comm shrunk = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
  {
    ReformWatch watch(deadline_s, topo_.rank, "the survivors did not re-form",
                      " (another rank lost or frozen meanwhile)");
    rc = MPIX_Comm_shrink(comm_, &shrunk);
  }
  if (rc != MPI_SUCCESS) {
    EndThisRank(topo_.rank, MpiStatus(rc, "MPIX_Comm_shrink").message());
  }
  MPI_Comm_set_errhandler(shrunk, MPI_ERRORS_RETURN);
  g_world = shrunk;
  ++g_recoveries;
#else
  (void)deadline_s;
#endif
}

}  // namespace kerasdist::core
