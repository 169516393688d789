// The C API (c_api.h): translation between its C structs and the core's
// types, and nothing else. The process's runtimes and its process sets are
// process_sets.cc's; enqueue.cc turns a kerasdist_tensor into the runtime's
// Entry; the handle API is handles.cc's, built on kerasdist_enqueue_tensors
// like every other front end.
#include "c_api.h"

#ifdef KERASDIST_NO_MPI  // ops/Makefile: a source in CORE_PLAIN_SRCS
#error "this source sees mpi.h: list it in ops/Makefile's CORE_MPI_SRCS"
#endif
#include <mpi.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "backends/gpu/device_backend.h"
#include "config.h"
#include "control/liveness.h"
#include "enqueue.h"
#include "half_kernels.h"
#include "process_sets.h"
#include "timeline.h"
#include "transport/mpi_context.h"
#include "transport/tcp_job.h"
#include "types.h"

#ifndef KERASDIST_VERSION
#define KERASDIST_VERSION "0.0.0"
#endif

namespace kerasdist::core {

namespace {

thread_local std::string t_last_error;
thread_local std::string t_text;

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

}  // namespace kerasdist::core

using namespace kerasdist::core;

extern "C" {

int kerasdist_init(int has_comm, int comm_f, const char* settings) {
  Status s = StartJob(settings, has_comm != 0, comm_f);
  return s.ok() ? 0 : Fail(s.message());
}

int kerasdist_set_tcp_job(const char* spec) {
  Status s = SetTcpJob(spec ? spec : "");
  return s.ok() ? 0 : Fail(s.message());
}

const char* kerasdist_transport(void) {
  std::shared_ptr<Runtime> rt = CurrentRuntime();
  t_text = rt ? rt->transport_name() : "";
  return t_text.c_str();
}

int kerasdist_lost_ranks(int32_t* out, int cap) {
  const std::vector<int> lost = LastLostRanks();
  for (int i = 0; i < cap && i < static_cast<int>(lost.size()); ++i) {
    out[i] = lost[i];
  }
  return static_cast<int>(lost.size());
}

int kerasdist_shutdown(void) {
  StopJob();
  return 0;
}

int kerasdist_is_initialized(void) { return CurrentRuntime() ? 1 : 0; }

int kerasdist_recoveries(void) { return Recoveries(); }

int kerasdist_grow(int count, const char* const* argvs,
                   const char* const* hosts) {
  std::vector<std::vector<std::string>> commands;
  std::vector<std::string> where;
  for (int i = 0; i < count; ++i) {
    std::vector<std::string> words;
    std::string word;
    for (const char* c = argvs[i]; *c != '\0'; ++c) {
      if (*c == '\x1f') {
        words.push_back(word);
        word.clear();
      } else {
        word += *c;
      }
    }
    words.push_back(word);
    commands.push_back(words);
    where.push_back(hosts != nullptr && hosts[i] != nullptr ? hosts[i] : "");
  }
  Status s = GrowJob(commands, where, 0.0);
  return s.ok() ? 0 : Fail(s.message());
}

int kerasdist_grows(void) { return Grows(); }

int kerasdist_shrink(int leave, double deadline_s) {
  Status s = ShrinkJob(leave != 0, deadline_s);
  return s.ok() ? 0 : Fail(s.message());
}

int kerasdist_shrinks(void) { return Shrinks(); }

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

int kerasdist_enqueue_tensors(const kerasdist_tensor* tensors, int32_t n,
                              int32_t* queued) {
  int32_t count = 0;
  Status s = EnqueueTensors(tensors, n, &count);
  if (queued != nullptr) *queued = count;
  if (s.ok()) return 0;
  Fail(s.message());
  return static_cast<int>(s.code());
}

int kerasdist_enqueue_cb(const kerasdist_request* r, const void* input,
                         void* output, void* ready_event,
                         kerasdist_done_fn done, void* arg) {
  if (done == nullptr)
    return Fail("kerasdist_enqueue_cb needs a done callback.");
  kerasdist_tensor t{r, input, output, ready_event, nullptr, done, arg};
  return kerasdist_enqueue_tensors(&t, 1, nullptr) == 0 ? 0 : -1;
}

int kerasdist_add_process_set(const int32_t* ranks, int32_t n) {
  std::vector<int32_t> set(ranks, ranks + std::max(n, 0));
  int32_t id = -1;
  Status s = AddProcessSet(set, &id);
  return s.ok() ? id : Fail(s.message());
}

int kerasdist_remove_process_set(int32_t id) {
  Status s = RemoveProcessSet(id);
  return s.ok() ? 0 : Fail(s.message());
}

int kerasdist_process_set_ids(int32_t* ids, int32_t cap) {
  std::vector<int32_t> all;
  if (!ProcessSetIds(&all)) return -1;
  std::copy_n(all.begin(), std::min<size_t>(all.size(), std::max(cap, 0)), ids);
  return static_cast<int>(all.size());
}

int kerasdist_process_set_ranks(int32_t id, int32_t* ranks, int32_t cap) {
  std::vector<int32_t> set;
  Status s = ProcessSetRanks(id, &set);
  if (!s.ok()) return Fail(s.message());
  std::copy_n(set.begin(), std::min<size_t>(set.size(), std::max(cap, 0)),
              ranks);
  return static_cast<int>(set.size());
}

int kerasdist_process_set_rank(int32_t id) { return ProcessSetRank(id); }

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
