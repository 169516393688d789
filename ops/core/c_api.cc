#include "c_api.h"

#ifdef KERASDIST_NO_MPI  // ops/Makefile: a source in CORE_PLAIN_SRCS
#error "this source sees mpi.h: list it in ops/Makefile's CORE_MPI_SRCS"
#endif
#include <mpi.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include "backends/gpu/device_backend.h"
#include "config.h"
#include "global.h"
#include "half_kernels.h"
#include "timeline.h"
#include "transport/mpi_context.h"
#include "types.h"

#ifndef KERASDIST_VERSION
#define KERASDIST_VERSION "0.0.0"
#endif

namespace kerasdist::core {

namespace {

std::mutex g_mu;  // guards g_runtime, g_sets and g_handles
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

std::string RankList(const std::vector<int32_t>& ranks) {
  std::string s;
  for (int32_t r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

std::string SetLabel(int32_t id, const std::vector<int32_t>& ranks) {
  return "process set " + std::to_string(id) + " (ranks " + RankList(ranks) +
         ")";
}
thread_local std::string t_last_error;
thread_local std::string t_text;

// One tensor enqueued through the C API. It ends either through the
// caller's callback (kerasdist_enqueue_cb) or, for a handle, by recording
// the result for kerasdist_wait and friends (mu guards what follows it).
struct HandleState {
  kerasdist_done_fn callback = nullptr;
  void* callback_arg = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Result result;
  std::vector<char> owned;
  std::vector<int64_t> shape;
};
std::map<int64_t, std::shared_ptr<HandleState>> g_handles;
int64_t g_next_handle = 1;

std::shared_ptr<HandleState> FindHandle(int64_t h) {
  std::lock_guard<std::mutex> l(g_mu);
  auto it = g_handles.find(h);
  return it == g_handles.end() ? nullptr : it->second;
}

int Fail(const std::string& message) {
  t_last_error = message;
  return -1;
}

// "name=value" lines of an enum's table.
const char* EnumText(const std::vector<EnumName>& names) {
  t_text.clear();
  for (const EnumName& n : names) {
    t_text += std::string(n.name) + "=" + std::to_string(n.value) + "\n";
  }
  return t_text.c_str();
}

}  // namespace

std::shared_ptr<Runtime> CurrentRuntime() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_runtime;
}

Status RuntimeForSet(int id, Request* q, std::shared_ptr<Runtime>* out) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_runtime) {
    return Status::Precondition(
        "kerasdist is not initialized; call kerasdist.init() first.");
  }
  if (id == 0) {
    *out = g_runtime;
    return Status::OK();
  }
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

}  // namespace kerasdist::core

using namespace kerasdist::core;

extern "C" {

int kerasdist_init(int has_comm, int comm_f, const char* settings) {
  std::lock_guard<std::mutex> l(g_mu);
  if (g_runtime) {
    if (g_runtime->stopped_status().ok()) return 0;
    g_runtime.reset();  // stopped by another rank's shutdown: start afresh
  }
  Config config;
  Status s = LoadConfig(settings ? settings : "", &config);
  if (!s.ok()) return Fail(s.message());
  std::unique_ptr<Runtime> rt;
  s = Runtime::Start(config, has_comm != 0, comm_f, &rt);
  if (!s.ok()) return Fail(s.message());
  // Collective like init itself. (A communicator of an earlier init is
  // left alone: freeing it is collective, and a rank may shut down alone.)
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  g_sets_comm = MPI_COMM_NULL;
  if (level == MPI_THREAD_MULTIPLE) {
    MPI_Comm parent = has_comm ? MPI_Comm_f2c(comm_f) : MPI_COMM_WORLD;
    if (MPI_Comm_dup(parent, &g_sets_comm) != MPI_SUCCESS)
      g_sets_comm = MPI_COMM_NULL;
  }
  g_sets.clear();
  g_runtime = std::move(rt);
  return 0;
}

int kerasdist_shutdown(void) {
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
  return 0;
}

int kerasdist_is_initialized(void) { return CurrentRuntime() ? 1 : 0; }

const char* kerasdist_last_error(void) { return t_last_error.c_str(); }

#define KD_TOPO(field)        \
  auto rt = CurrentRuntime(); \
  return rt ? rt->topology().field : -1;

int kerasdist_rank(void) { KD_TOPO(rank) }
int kerasdist_size(void) { KD_TOPO(size) }
int kerasdist_local_rank(void) { KD_TOPO(local_rank) }
int kerasdist_local_size(void) { KD_TOPO(local_size) }
int kerasdist_cross_rank(void) { KD_TOPO(cross_rank) }
int kerasdist_cross_size(void) { KD_TOPO(cross_size) }

int kerasdist_mpi_built(void) { return 1; }

// nccl_communicator.cc registers the GPU backend when it is compiled in.
int kerasdist_nccl_built(void) {
  return RegisteredDeviceBackend().factory ? 1 : 0;
}

const char* kerasdist_build_info(void) {
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(lib, &len);
  std::string mpi(lib, len);
  size_t nl = mpi.find('\n');
  if (nl != std::string::npos) mpi = mpi.substr(0, nl);
  int major = 0, minor = 0;
  MPI_Get_version(&major, &minor);
  std::ostringstream o;
  o << "kerasdist=" << KERASDIST_VERSION << "\n"
    << "mpi=1\n"
    << "mpi_standard=" << major << "." << minor << "\n"
    << "mpi_library=" << mpi << "\n"
    << "nccl=" << kerasdist_nccl_built() << "\n"
    << "gpu_backend=" << RegisteredDeviceBackend().version << "\n"
    << "compiler=" << __VERSION__ << "\n";
  t_text = o.str();
  return t_text.c_str();
}

const char* kerasdist_config_variables(void) {
  t_text.clear();
  for (const auto& v : ConfigVariables()) t_text += std::string(v.name) + "\n";
  return t_text.c_str();
}

const char* kerasdist_current_config(void) {
  auto rt = CurrentRuntime();
  t_text = rt ? FormatConfig(rt->config()) : "";
  return t_text.c_str();
}

const char* kerasdist_settings_table(void) {
  const Config defaults;
  t_text.clear();
  for (const Setting& s : Settings()) {
    t_text += std::string(s.name) + "\t" + s.key + "\t" +
              (s.in_init ? "1" : "0") + "\t" + FormatSetting(s, defaults) +
              "\t" + s.doc + "\n";
  }
  return t_text.c_str();
}

const char* kerasdist_resolve_config(const char* settings) {
  Config config;
  Status s = LoadConfig(settings ? settings : "", &config);
  if (!s.ok()) {
    Fail(s.message());
    return nullptr;
  }
  t_text = FormatConfig(config);
  return t_text.c_str();
}

const char* kerasdist_parse_setting(const char* name, const char* value) {
  if (name == nullptr || value == nullptr) {
    Fail("kerasdist_parse_setting needs a name and a value.");
    return nullptr;
  }
  Config config;
  Status s = ApplySetting(name, value, &config);
  if (!s.ok()) {
    Fail(s.message());
    return nullptr;
  }
  for (const Setting& row : Settings()) {
    if (std::string(name) == row.name) t_text = FormatSetting(row, config);
  }
  return t_text.c_str();
}

const char* kerasdist_dtypes(void) { return EnumText(DataTypeNames()); }
const char* kerasdist_reduce_ops(void) { return EnumText(ReduceOpNames()); }
const char* kerasdist_op_types(void) { return EnumText(OpTypeNames()); }

const char* kerasdist_timeline_phases(void) {
  t_text.clear();
  for (const TimelinePhase& p : TimelinePhases()) {
    t_text += std::string(p.name) + "=" + p.role + "\n";
  }
  return t_text.c_str();
}

#define KD_REQUIRE_RUNTIME(rt) \
  auto rt = CurrentRuntime();  \
  if (!rt)                     \
    return Fail("kerasdist is not initialized; call kerasdist.init() first.");

int kerasdist_start_timeline(const char* path, int mark_cycles) {
  KD_REQUIRE_RUNTIME(rt)
  if (path == nullptr || *path == '\0')
    return Fail("start_timeline needs a file path.");
  Status s = rt->StartTimeline(path, mark_cycles != 0);
  return s.ok() ? 0 : Fail(s.message());
}

int kerasdist_label_tensor(const char* name, const char* label) {
  if (name == nullptr || label == nullptr)
    return Fail("label_tensor needs a tensor name and a label.");
  SetTensorLabel(name, label);
  return 0;
}

int kerasdist_stop_timeline(void) {
  KD_REQUIRE_RUNTIME(rt)
  rt->StopTimeline();
  return 0;
}

int kerasdist_stats(int64_t* allreduced_bytes, int64_t* collectives,
                    double* busy_seconds) {
  KD_REQUIRE_RUNTIME(rt)
  Runtime::Stats s = rt->stats();
  *allreduced_bytes = s.allreduced_bytes;
  *collectives = s.batches;
  *busy_seconds = s.busy_seconds;
  return 0;
}

int kerasdist_set_tunables(int64_t fusion_threshold_bytes, double cycle_time_ms,
                           int cache_enabled) {
  KD_REQUIRE_RUNTIME(rt)
  if (fusion_threshold_bytes < 0 || !(cycle_time_ms >= 0)) {
    return Fail(
        "tunables must be >= 0 (fusion threshold in bytes, cycle time in ms).");
  }
  rt->SetTunables(fusion_threshold_bytes, cycle_time_ms, cache_enabled != 0);
  return 0;
}

int kerasdist_get_tunables(int64_t* fusion_threshold_bytes,
                           double* cycle_time_ms, int* cache_enabled) {
  KD_REQUIRE_RUNTIME(rt)
  bool cache = true;
  rt->GetTunables(fusion_threshold_bytes, cycle_time_ms, &cache);
  *cache_enabled = cache ? 1 : 0;
  return 0;
}

namespace {

Request RequestFromC(const kerasdist_request* r) {
  Request q;
  q.name = r->name ? r->name : "";
  q.op = static_cast<OpType>(r->op);
  q.reduce_op = static_cast<ReduceOp>(r->reduce_op);
  q.dtype = static_cast<DataType>(r->dtype);
  q.shape.assign(r->shape, r->shape + r->ndim);
  q.root_rank = r->root_rank;
  q.prescale = r->prescale;
  q.postscale = r->postscale;
  if (r->nsplits > 0) q.splits.assign(r->splits, r->splits + r->nsplits);
  q.group = r->group ? r->group : "";
  q.group_size = r->group_size;
  q.device = r->device;
  if (q.op == OpType::kBarrier) q.shape.clear();
  if (q.op == OpType::kJoin) {  // no tensor; the result is an int32 rank
    q.shape.clear();
    q.dtype = DataType::kInt32;
    q.device = -1;
  }
  return q;
}

// The entry's allocate: into the caller's `output` when it gave one (it knows
// the result's size), else into memory the handle owns (host only).
std::function<Status(const std::vector<int64_t>&, void**)> AllocateFor(
    std::shared_ptr<HandleState> state, void* output, const Request& q) {
  const int64_t esize = DataTypeSize(q.dtype);
  const bool on_device = q.device >= 0;
  return [state, output, esize, on_device](const std::vector<int64_t>& shape,
                                           void** data) {
    state->shape = shape;
    if (output == nullptr && on_device) {
      return Status::InvalidArgument(
          "a device tensor needs a preallocated output of the result's size "
          "(the C API allocates host memory only).");
    }
    if (output != nullptr) {
      *data = output;
    } else {
      state->owned.resize(std::max<int64_t>(NumElements(shape) * esize, 1));
      *data = state->owned.data();
    }
    return Status::OK();
  };
}

}  // namespace

namespace {

// The entry's done: hands the result to the caller's callback, or keeps it
// for the handle's waiters.
void Finish(HandleState& state, const Result& res) {
  if (state.callback != nullptr) {
    kerasdist_result out{};
    out.status = static_cast<int32_t>(res.status.code());
    out.message = res.status.message().c_str();
    out.ndim = static_cast<int32_t>(state.shape.size());
    out.shape = state.shape.data();
    out.data = state.owned.empty() ? nullptr : state.owned.data();
    out.nsplits = static_cast<int32_t>(res.recv_splits.size());
    out.recv_splits = res.recv_splits.data();
    state.callback(state.callback_arg, &out);
    return;
  }
  std::lock_guard<std::mutex> l(state.mu);
  state.result = res;
  state.done = true;
  state.cv.notify_all();
}

// What kerasdist_enqueue and kerasdist_enqueue_cb share: checks the request
// and queues it; on an error `state` is never finished.
Status Submit(const kerasdist_request* r, const void* input, void* output,
              void* ready_event, std::shared_ptr<HandleState> state) {
  if (!CurrentRuntime()) {
    return Status::Precondition(
        "kerasdist is not initialized; call kerasdist.init() first.");
  }
  if (r == nullptr || !IsValidOpType(r->op) || !IsValidDataType(r->dtype) ||
      !IsValidReduceOp(r->reduce_op) || r->ndim < 0 || r->ndim > 32) {
    return Status::InvalidArgument(
        "invalid request: unknown op, dtype or reduce op, or more than 32 "
        "dimensions.");
  }
  Entry e;
  e.req = RequestFromC(r);
  std::shared_ptr<Runtime> rt;
  KD_RETURN_IF_ERROR(RuntimeForSet(r->process_set, &e.req, &rt));
  e.input = input;
  e.output = output;
  e.ready_event = e.req.device >= 0 ? ready_event : nullptr;
  e.allocate = AllocateFor(state, output, e.req);
  state->shape = e.req.shape;
  e.done = [state = std::move(state)](const Result& res) {
    Finish(*state, res);
  };
  return rt->Enqueue(std::move(e));
}

}  // namespace

int kerasdist_enqueue_cb(const kerasdist_request* r, const void* input,
                         void* output, void* ready_event,
                         kerasdist_done_fn done, void* arg) {
  if (done == nullptr)
    return Fail("kerasdist_enqueue_cb needs a done callback.");
  auto state = std::make_shared<HandleState>();
  state->callback = done;
  state->callback_arg = arg;
  Status s = Submit(r, input, output, ready_event, std::move(state));
  return s.ok() ? 0 : Fail(s.message());
}

int64_t kerasdist_enqueue(const kerasdist_request* r, const void* input,
                          void* output) {
  auto state = std::make_shared<HandleState>();
  int64_t handle;
  {
    std::lock_guard<std::mutex> l(g_mu);
    handle = g_next_handle++;
    g_handles[handle] = state;
  }
  Status s = Submit(r, input, output, nullptr, std::move(state));
  if (!s.ok()) {
    std::lock_guard<std::mutex> l(g_mu);
    g_handles.erase(handle);
    Fail(s.message());
    return 0;
  }
  return handle;
}

int kerasdist_wait(int64_t handle, double timeout_s) {
  auto st = FindHandle(handle);
  if (!st) return 1;
  std::unique_lock<std::mutex> l(st->mu);
  if (timeout_s < 0) {
    st->cv.wait(l, [&] { return st->done; });
    return 1;
  }
  return st->cv.wait_for(l, std::chrono::duration<double>(timeout_s),
                         [&] { return st->done; })
             ? 1
             : 0;
}

int kerasdist_handle_status(int64_t handle) {
  auto st = FindHandle(handle);
  if (!st) return static_cast<int>(StatusCode::kInvalidArgument);
  std::lock_guard<std::mutex> l(st->mu);
  return static_cast<int>(st->result.status.code());
}

const char* kerasdist_handle_message(int64_t handle) {
  auto st = FindHandle(handle);
  t_text = st ? st->result.status.message() : "unknown handle";
  return t_text.c_str();
}

const void* kerasdist_handle_output(int64_t handle, int32_t* ndim,
                                    int64_t* shape) {
  auto st = FindHandle(handle);
  if (!st) return nullptr;
  std::lock_guard<std::mutex> l(st->mu);
  *ndim = static_cast<int32_t>(st->shape.size());
  for (size_t i = 0; i < st->shape.size() && i < 32; ++i)
    shape[i] = st->shape[i];
  return st->owned.empty() ? nullptr : st->owned.data();
}

int kerasdist_handle_recv_splits(int64_t handle, int64_t* splits) {
  auto st = FindHandle(handle);
  if (!st) return 0;
  std::lock_guard<std::mutex> l(st->mu);
  for (size_t i = 0; i < st->result.recv_splits.size(); ++i) {
    splits[i] = st->result.recv_splits[i];
  }
  return static_cast<int>(st->result.recv_splits.size());
}

void kerasdist_release(int64_t handle) {
  std::lock_guard<std::mutex> l(g_mu);
  g_handles.erase(handle);
}

namespace {

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
  if (!*rt) {
    return Status::Precondition(
        "kerasdist is not initialized; call kerasdist.init() first.");
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
  {
    std::lock_guard<std::mutex> l(g_mu);
    for (const auto& [k, v] : g_sets) {
      if (v.ranks == set) {
        return Status::InvalidArgument(
            "add_process_set: a process set of ranks " + RankList(set) +
            " exists already (id " + std::to_string(k) + ").");
      }
    }
  }
  return Status::OK();
}

Status AddProcessSet(const int32_t* ranks, int32_t n, int32_t* id) {
  std::shared_ptr<Runtime> rt;
  KD_RETURN_IF_ERROR(RequireSets(&rt));
  const Topology& topo = rt->topology();
  std::vector<int32_t> set(ranks, ranks + std::max(n, 0));
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
    Config config = rt->config();
    config.heartbeat_timeout_s = 0;  // the job's heartbeat watches every rank
    config.timeline_path.clear();
    RuntimeRole role;
    role.label = SetLabel(new_id, set);
    role.parent = rt;
    started = Runtime::Start(config, true, MPI_Comm_c2f(sub), &srt, role);
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

Status RemoveProcessSet(int32_t id) {
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

int kerasdist_add_process_set(const int32_t* ranks, int32_t n) {
  std::lock_guard<std::mutex> op(g_sets_op_mu);
  int32_t id = -1;
  Status s = AddProcessSet(ranks, n, &id);
  return s.ok() ? id : Fail(s.message());
}

int kerasdist_remove_process_set(int32_t id) {
  std::lock_guard<std::mutex> op(g_sets_op_mu);
  Status s = RemoveProcessSet(id);
  return s.ok() ? 0 : Fail(s.message());
}

int kerasdist_process_set_ids(int32_t* ids, int32_t cap) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_runtime) return -1;
  int n = 0;
  if (n < cap) ids[n] = 0;
  ++n;
  for (const auto& [k, v] : g_sets) {
    if (n < cap) ids[n] = k;
    ++n;
  }
  return n;
}

int kerasdist_process_set_ranks(int32_t id, int32_t* ranks, int32_t cap) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_runtime) return Fail("kerasdist is not initialized.");
  if (id == 0) {
    const int size = g_runtime->topology().size;
    for (int i = 0; i < size && i < cap; ++i) ranks[i] = i;
    return size;
  }
  auto it = g_sets.find(id);
  if (it == g_sets.end())
    return Fail("process set " + std::to_string(id) + " does not exist.");
  const auto& set = it->second.ranks;
  for (size_t i = 0; i < set.size() && static_cast<int>(i) < cap; ++i)
    ranks[i] = set[i];
  return static_cast<int>(set.size());
}

int kerasdist_process_set_rank(int32_t id) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_runtime) return -2;
  if (id == 0) return g_runtime->topology().rank;
  auto it = g_sets.find(id);
  if (it == g_sets.end()) return -2;
  return it->second.rt ? it->second.rt->topology().rank : -1;
}

int kerasdist_convert16(int32_t dtype, int to_float, int simd, const void* in,
                        void* out, int64_t n) {
  if (dtype != static_cast<int32_t>(DataType::kFloat16) &&
      dtype != static_cast<int32_t>(DataType::kBFloat16)) {
    return Fail(
        "kerasdist_convert16: dtype must be float16 (0) or bfloat16 (1), got " +
        std::to_string(dtype) + ".");
  }
  if (n < 0) return Fail("kerasdist_convert16: negative count.");
  const DataType dt = static_cast<DataType>(dtype);
  const Simd mode = simd ? Simd::kAuto : Simd::kScalar;
  if (to_float) {
    Widen16(dt, static_cast<const uint16_t*>(in), static_cast<float*>(out), n,
            mode);
  } else {
    Narrow16(dt, static_cast<const float*>(in), static_cast<uint16_t*>(out), n,
             mode);
  }
  return 0;
}

int kerasdist_simd16(void) { return Simd16Available() ? 1 : 0; }

const char* kerasdist_backends(void) {
  auto rt = CurrentRuntime();
  t_text = rt ? rt->BackendNames() : "";
  return t_text.c_str();
}

int64_t kerasdist_backend_runs(const char* name) {
  auto rt = CurrentRuntime();
  return rt && name ? rt->BackendRuns(name) : -1;
}

}  // extern "C"
