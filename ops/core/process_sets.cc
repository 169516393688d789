#include "process_sets.h"

#ifdef KERASDIST_NO_MPI  // ops/Makefile: a source in CORE_PLAIN_SRCS
#error "this source sees mpi.h: list it in ops/Makefile's CORE_MPI_SRCS"
#endif
#include <mpi.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "config.h"
#include "transport/mpi_context.h"

namespace kerasdist::core {

namespace {

std::mutex g_mu;  // guards g_runtime and g_sets
std::shared_ptr<Runtime> g_runtime;

// A process set other than the whole job: its ranks (of the job) and, on
// its members, its runtime.
struct ProcessSetInfo {
  std::vector<int32_t> ranks;
  std::shared_ptr<Runtime> rt;
};
std::map<int32_t, ProcessSetInfo> g_sets;
// Adding and removing sets, one at a time (guards g_sets_comm too).
std::mutex g_sets_op_mu;
// A duplicate of the job's communicator that only adding and removing sets
// use, from the caller's thread: the runtimes' threads never touch it.
// MPI_COMM_NULL where MPI runs below MPI_THREAD_MULTIPLE (those calls would
// race the runtime's thread).
MPI_Comm g_sets_comm = MPI_COMM_NULL;

const char kNotInitialized[] =
    "kerasdist is not initialized; call kerasdist.init() first.";

std::string RankList(const std::vector<int32_t>& ranks) {
  std::string s;
  for (int32_t r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

std::string SetLabel(int32_t id, const std::vector<int32_t>& ranks) {
  return "process set " + std::to_string(id) + " (ranks " + RankList(ranks) +
         ")";
}

// The communicator for adding and removing sets: collective like init
// itself. (A communicator of an earlier init is left alone: freeing it is
// collective, and a rank may shut down alone.)
MPI_Comm DupForSets(bool has_comm, int comm_f) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return MPI_COMM_NULL;  // a TCP job: no sets yet
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level != MPI_THREAD_MULTIPLE) return MPI_COMM_NULL;
  MPI_Comm parent = has_comm ? MPI_Comm_f2c(comm_f) : JobWorld();
  MPI_Comm dup = MPI_COMM_NULL;
  if (MPI_Comm_dup(parent, &dup) != MPI_SUCCESS) return MPI_COMM_NULL;
  return dup;
}

// Set `id`'s runtime for `q` (g_mu held, set 0 handled by the caller).
Status SetRuntime(int id, Request* q, std::shared_ptr<Runtime>* out) {
  auto it = g_sets.find(id);
  if (it == g_sets.end()) {
    std::string ids = "0";
    for (const auto& [k, v] : g_sets) ids += ", " + std::to_string(k);
    return Status::InvalidArgument(
        "process set " + std::to_string(id) + " does not exist (the sets are " +
        ids +
        "); add it with kerasdist.add_process_set() or "
        "kerasdist.init(process_sets=...).");
  }
  const ProcessSetInfo& ps = it->second;
  if (!ps.rt) {
    return Status::InvalidArgument(
        "rank " + std::to_string(g_runtime->topology().rank) + " is not in " +
        SetLabel(id, ps.ranks) +
        ": only the set's members may run its collectives (check "
        "process_set.included() first).");
  }
  if (q->op == OpType::kBroadcast) {
    auto r = std::find(ps.ranks.begin(), ps.ranks.end(), q->root_rank);
    if (r == ps.ranks.end()) {
      return Status::InvalidArgument(
          "broadcast '" + q->name + "' on " + SetLabel(id, ps.ranks) +
          ": root_rank " + std::to_string(q->root_rank) +
          " is not in the set; root_rank is a rank of the job (as in "
          "Horovod) and must be one of the set's ranks.");
    }
    q->root_rank = static_cast<int32_t>(r - ps.ranks.begin());
  }
  *out = ps.rt;
  return Status::OK();
}

// Collective over g_sets_comm: whether every rank passed the same `values`.
Status AllAgree(const std::vector<int64_t>& values, const char* what) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : values)
    h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  uint64_t mine[2] = {h, ~h}, low[2] = {0, 0};
  int rc = MPI_Allreduce(mine, low, 2, MPI_UINT64_T, MPI_MIN, g_sets_comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Allreduce");
  if (low[0] != h || low[1] != ~h) {
    return Status::InvalidArgument(
        std::string(what) +
        ": the ranks did not all pass the same arguments; every rank of the "
        "job must make the same add_process_set / remove_process_set calls, "
        "in the same order.");
  }
  return Status::OK();
}

Status RequireSets(std::shared_ptr<Runtime>* rt) {
  *rt = CurrentRuntime();
  if (!*rt) return Status::Precondition(kNotInitialized);
  if ((*rt)->transport_name() != "mpi") {
    return Status::Precondition(
        "process sets other than the global one need the MPI transport; "
        "this job runs over TCP (KERASDIST_TRANSPORT=tcp).");
  }
  if (g_sets_comm == MPI_COMM_NULL) {
    return Status::Precondition(
        "process sets need MPI initialized with MPI_THREAD_MULTIPLE (each "
        "set's runtime has a thread of its own); this MPI runs with less. "
        "Let kerasdist initialize MPI, or initialize it with "
        "MPI_THREAD_MULTIPLE (mpi4py's default).");
  }
  return Status::OK();
}

// The ranks of a new set are ranks of the job, sorted, neither the whole job
// nor an existing set's.
Status CheckNewSet(const std::vector<int32_t>& set, const Topology& topo) {
  if (set.empty())
    return Status::InvalidArgument("add_process_set needs at least one rank.");
  for (size_t i = 0; i < set.size(); ++i) {
    if (set[i] < 0 || set[i] >= topo.size || (i > 0 && set[i] <= set[i - 1])) {
      return Status::InvalidArgument(
          "add_process_set: ranks must be distinct ranks of the job in [0, " +
          std::to_string(topo.size) + "), sorted; got " + RankList(set) + ".");
    }
  }
  if (static_cast<int>(set.size()) == topo.size) {
    return Status::InvalidArgument(
        "add_process_set: ranks " + RankList(set) +
        " are the whole job, which is the global process set (id 0) already.");
  }
  std::lock_guard<std::mutex> l(g_mu);
  for (const auto& [k, v] : g_sets) {
    if (v.ranks == set) {
      return Status::InvalidArgument(
          "add_process_set: a process set of ranks " + RankList(set) +
          " exists already (id " + std::to_string(k) + ").");
    }
  }
  return Status::OK();
}

// On a member of the new set: its runtime over `sub` (a communicator of the
// set's ranks), a child of the job's runtime `rt`.
Status StartSetRuntime(const std::shared_ptr<Runtime>& rt, MPI_Comm sub,
                       const std::string& label,
                       std::unique_ptr<Runtime>* out) {
  Config config = rt->config();
  config.heartbeat_timeout_s = 0;  // the job's heartbeat watches every rank
  config.timeline_path.clear();
  RuntimeRole role;
  role.label = label;
  role.parent = rt;
  return Runtime::Start(config, true, MPI_Comm_c2f(sub), out, role);
}

Status AddSetLocked(const std::vector<int32_t>& set, int32_t* id) {
  std::shared_ptr<Runtime> rt;
  KD_RETURN_IF_ERROR(RequireSets(&rt));
  const Topology& topo = rt->topology();
  std::vector<int64_t> key(set.begin(), set.end());
  key.push_back(-1);
  // Agreement first, so that every rank fails alike.
  KD_RETURN_IF_ERROR(AllAgree(key, "add_process_set"));
  KD_RETURN_IF_ERROR(CheckNewSet(set, topo));
  const bool member =
      std::binary_search(set.begin(), set.end(), int32_t(topo.rank));
  MPI_Comm sub = MPI_COMM_NULL;
  int rc =
      MPI_Comm_split(g_sets_comm, member ? 0 : MPI_UNDEFINED, topo.rank, &sub);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Comm_split");
  // The smallest free id, as Horovod reuses them (the same on every rank:
  // every rank has made the same calls).
  int32_t new_id = 1;
  {
    std::lock_guard<std::mutex> l(g_mu);
    while (g_sets.count(new_id)) ++new_id;
  }
  std::unique_ptr<Runtime> srt;
  Status started;
  if (member) {
    started = StartSetRuntime(rt, sub, SetLabel(new_id, set), &srt);
    MPI_Comm_free(&sub);
  }
  // Every rank learns whether every member started.
  int good = started.ok() ? 1 : 0, all = 0;
  rc = MPI_Allreduce(&good, &all, 1, MPI_INT, MPI_MIN, g_sets_comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Allreduce");
  if (!all) {
    if (srt) srt->Shutdown();
    return started.ok() ? Status::Internal(
                              "add_process_set: another member "
                              "of the set failed to start it.")
                        : started;
  }
  std::lock_guard<std::mutex> l(g_mu);
  g_sets[new_id] = ProcessSetInfo{set, std::shared_ptr<Runtime>(srt.release())};
  *id = new_id;
  return Status::OK();
}

Status RemoveSetLocked(int32_t id) {
  std::shared_ptr<Runtime> rt;
  KD_RETURN_IF_ERROR(RequireSets(&rt));
  KD_RETURN_IF_ERROR(AllAgree({id}, "remove_process_set"));
  if (id == 0) {
    return Status::InvalidArgument(
        "remove_process_set: the global process set (id 0) cannot be "
        "removed.");
  }
  ProcessSetInfo ps;
  {
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_sets.find(id);
    if (it == g_sets.end()) {
      return Status::InvalidArgument("remove_process_set: process set " +
                                     std::to_string(id) + " does not exist.");
    }
    ps = std::move(it->second);
    g_sets.erase(it);
  }
  if (ps.rt) ps.rt->Shutdown();
  return Status::OK();
}

}  // namespace

Status StartJob(const char* settings, bool has_comm, int comm_f) {
  std::lock_guard<std::mutex> l(g_mu);
  if (g_runtime) {
    if (g_runtime->stopped_status().ok()) return Status::OK();
    g_runtime.reset();  // stopped by another rank's shutdown: start afresh
  }
  Config config;
  KD_RETURN_IF_ERROR(LoadConfig(settings ? settings : "", &config));
  std::unique_ptr<Runtime> rt;
  KD_RETURN_IF_ERROR(Runtime::Start(config, has_comm, comm_f, &rt));
  g_sets_comm = DupForSets(has_comm, comm_f);
  g_sets.clear();
  g_runtime = std::move(rt);
  return Status::OK();
}

void StopJob() {
  std::shared_ptr<Runtime> rt;
  std::map<int32_t, ProcessSetInfo> sets;
  {
    std::lock_guard<std::mutex> l(g_mu);
    rt.swap(g_runtime);
    sets.swap(g_sets);
  }
  // The sets' runtimes first: each one's goodbyes go over its own
  // communicator while the job's runtime still runs.
  for (auto& [id, ps] : sets) {
    if (ps.rt) ps.rt->Shutdown();
  }
  sets.clear();
  if (rt) rt->Shutdown();
}

std::shared_ptr<Runtime> CurrentRuntime() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_runtime;
}

Status RuntimeForSet(int id, Request* q, std::shared_ptr<Runtime>* out) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_runtime) return Status::Precondition(kNotInitialized);
  if (id != 0) return SetRuntime(id, q, out);
  *out = g_runtime;
  return Status::OK();
}

Status AddProcessSet(const std::vector<int32_t>& ranks, int32_t* id) {
  std::lock_guard<std::mutex> op(g_sets_op_mu);
  return AddSetLocked(ranks, id);
}

Status RemoveProcessSet(int32_t id) {
  std::lock_guard<std::mutex> op(g_sets_op_mu);
  return RemoveSetLocked(id);
}

bool ProcessSetIds(std::vector<int32_t>* ids) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_runtime) return false;
  ids->assign(1, 0);
  for (const auto& [k, v] : g_sets) ids->push_back(k);
  return true;
}

Status ProcessSetRanks(int32_t id, std::vector<int32_t>* ranks) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_runtime) return Status::Precondition("kerasdist is not initialized.");
  if (id == 0) {
    ranks->resize(g_runtime->topology().size);
    for (size_t i = 0; i < ranks->size(); ++i) (*ranks)[i] = i;
    return Status::OK();
  }
  auto it = g_sets.find(id);
  if (it == g_sets.end()) {
    return Status::InvalidArgument("process set " + std::to_string(id) +
                                   " does not exist.");
  }
  *ranks = it->second.ranks;
  return Status::OK();
}

int ProcessSetRank(int32_t id) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_runtime) return -2;
  if (id == 0) return g_runtime->topology().rank;
  auto it = g_sets.find(id);
  if (it == g_sets.end()) return -2;
  return it->second.rt ? it->second.rt->topology().rank : -1;
}

}  // namespace kerasdist::core
