#include "config.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <type_traits>

namespace kerasdist::core {

namespace {

using C = Config;

// The coordinator: fusion, the cache, stalls and deadlocks.
std::vector<Setting> CoordinatorSettings() {
  // clang-format off: one row per setting, its fields packed
  return {
      {"KERASDIST_FUSION_THRESHOLD", "fusion_threshold", true,
       &C::fusion_threshold_bytes, 0, {},
       "Tensor Fusion buffer size in bytes (0 disables fusion)"},
      {"KERASDIST_CYCLE_TIME", "cycle_time_ms", true, &C::cycle_time_ms, 0, {},
       "batching window in milliseconds: how long the coordinator may wait "
       "after the first ready tensor for more to fuse (0: run what is ready "
       "at once)"},
      {"KERASDIST_CACHE_CAPACITY", "cache_capacity", true,
       &C::cache_capacity, 0, {},
       "response cache entries (0 disables the cache)"},
      {"KERASDIST_STALL_CHECK_TIME_SECONDS", "stall_check_time_seconds", true,
       &C::stall_check_time_s, 0, {},
       "warn (on rank 0) when a tensor has waited this long for some ranks, "
       "naming it and the missing ranks (0 disables)"},
      {"KERASDIST_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_time_seconds",
       true,
       &C::stall_shutdown_time_s, 0, {},
       "fail every rank when a tensor has waited this long (0 = never)"},
      {"KERASDIST_DEADLOCK_SHUTDOWN_TIME_SECONDS",
       "deadlock_shutdown_time_seconds", true,
       &C::deadlock_shutdown_time_s, 0, {},
       "a certain deadlock (every rank waits on collectives that no other "
       "rank submitted, as after uneven data or a skipped collective) ends "
       "the job after this long with nothing submitted meanwhile: every "
       "rank's pending collectives fail with one line naming each rank's "
       "collectives and the likely cause (rank 0's value holds; 0 = never). "
       "See [failures-and-elastic.md]"
       "(failures-and-elastic.md#when-things-fail)"},
  };
  // clang-format on
}

// The heartbeat, the timeline, autotune, the GPU path's choice and logging.
std::vector<Setting> RuntimeSettings() {
  // clang-format off: one row per setting, its fields packed
  return {
      {"KERASDIST_HEARTBEAT_TIMEOUT_SECONDS", "heartbeat_timeout_seconds", true,
       &C::heartbeat_timeout_s, 0, {},
       "a rank not heard from for this long is lost: every rank that learns "
       "of it prints one line naming the lost ranks and their host and ends "
       "with exit code 75, so the job never hangs on a dead host, a cut link "
       "or a frozen rank (a rank alone in its job, frozen this long, is "
       "killed by its launcher's wrapper; rank 0's value holds for all; 0 "
       "turns the heartbeat off). See [failures-and-elastic.md]"
       "(failures-and-elastic.md#when-things-fail)"},
      {"KERASDIST_HEARTBEAT_INTERVAL_SECONDS", "heartbeat_interval_seconds",
       true, &C::heartbeat_interval_s, 0, {},
       "how often each rank and rank 0 send each other a heartbeat, from a "
       "thread of their own over TCP (rank 0's value holds for all)"},
      {"KERASDIST_NETWORK_INTERFACE", "network_interface", false,
       &C::network_interface, 0, {},
       "the interface whose address the other hosts reach rank 0's "
       "heartbeat at first (set by `kerasdist run --network-interface`)"},
      {"KERASDIST_TIMELINE", "timeline", true, &C::timeline_path, 0, {},
       "path of a Chrome-trace timeline written by rank 0 (empty: none)"},
      {"KERASDIST_TIMELINE_MARK_CYCLES", "timeline_mark_cycles", true,
       &C::timeline_mark_cycles, 0, {},
       "1 to mark every runtime cycle in the timeline"},
      {"KERASDIST_AUTOTUNE", "autotune", true, &C::autotune, 0, {},
       "1 to tune the fusion threshold, cycle time and response cache while "
       "training (rank 0; see [timeline.md](timeline.md#autotune))"},
      {"KERASDIST_AUTOTUNE_LOG", "autotune_log", true,
       &C::autotune_log, 0, {},
       "CSV file recording every autotune sample"},
      {"KERASDIST_GPU_OPERATIONS", "gpu_operations", false,
       Setting::Choice{0}, 0, {"NCCL", "MPI"},
       "`NCCL` or `MPI`: how collectives on GPU memory travel (`MPI`: staged "
       "through pinned host memory; see [gpu.md](gpu.md)); read only by a "
       "build with the GPU backend"},
      {"KERASDIST_LOG_LEVEL", "log_level", true, &C::log_level, 0, {},
       "0 quiet, 1 warnings, 2 debug"},
  };
  // clang-format on
}

// The data path's backends (their own settings, with no Config member: each
// backend reads its rows by name), and what the launcher sets.
std::vector<Setting> DataPathSettings() {
  // clang-format off: one row per setting, its fields packed
  return {
      {"KERASDIST_SHM_ALLREDUCE", "shm_allreduce", true,
       Setting::Flag{true}, 0, {},
       "1: when every rank runs on one node, allreduce, reducescatter and "
       "allgather host tensors through shared memory (POSIX shm in "
       "`/dev/shm`, up to 64 MiB a rank, space reserved up front; if any "
       "rank cannot get it, all use MPI); 0: always MPI. The ranks agree: "
       "one rank's 0 turns it off for all"},
      {"KERASDIST_CMA_ALLREDUCE", "cma_allreduce", true,
       Setting::Flag{true}, 0, {},
       "1: the single-node allreduce reads the other ranks' tensors in place "
       "with `process_vm_readv` (nothing staged in `/dev/shm`, no size limit) "
       "where every rank can; 0: stage them in the shared-memory slots. The "
       "ranks agree"},
      {"KERASDIST_CMA_MIN_TENSOR_BYTES", "cma_min_tensor_bytes", true,
       Setting::Int{4096}, 0, {},
       "with in-place reads on: a fused batch whose tensors average fewer "
       "bytes than this goes through the shared-memory slots instead, where "
       "one copy costs less than pinning each small tensor's page in the "
       "other rank (512 x 1 KiB: 0.60 ms against 0.73 ms a step); batches "
       "over 64 MiB always read in place. The ranks use the largest value "
       "given"},
      {"KERASDIST_SHM_ALLREDUCE_MIN_BYTES", "shm_allreduce_min_bytes", true,
       Setting::Int{16 * 1024}, 0, {},
       "smallest allreduce, reducescatter or allgather, in bytes after "
       "fusion, that takes the shared-memory path (the ranks use the "
       "largest value given)"},
      {"KERASDIST_HIERARCHICAL_ALLREDUCE", "hierarchical_allreduce", true,
       Setting::Flag{true}, 0, {},
       "1: when the job spans several hosts and some host runs more than "
       "one rank, allreduce within each host over its node path, across "
       "hosts among one leader per host, then within each host again, so "
       "each host's link carries the 2(H-1)/H x size minimum; 0: every rank "
       "in one MPI allreduce. The ranks agree: one rank's 0 turns it off"},
      {"KERASDIST_HIERARCHICAL_ALLGATHER", "hierarchical_allgather", true,
       Setting::Flag{true}, 0, {},
       "1: on such a job, allgather by gathering each host's parts on one "
       "leader per host, allgathering the hosts' blocks among the leaders "
       "and broadcasting the result within each host; 0: one MPI allgather. "
       "The ranks agree"},
      {"KERASDIST_HIERARCHICAL_MIN_BYTES", "hierarchical_min_bytes", true,
       Setting::Int{0}, 0, {},
       "smallest allreduce (in bytes after fusion) or allgather (bytes of "
       "the result) that goes hierarchical; smaller ones take one MPI "
       "collective. The ranks use the largest value given"},
      // Not a runtime knob: the launcher tells each rank which attempt it is
      // (--max-restarts), and the Trainer logs it. Listed here so its name
      // lives in one place with the others.
      {"KERASDIST_RESTART_ATTEMPT", "restart_attempt", false,
       &C::restart_attempt, 0, {},
       "0-based attempt number, set by `kerasdist run` under "
       "`--max-restarts`"},
  };
  // clang-format on
}

}  // namespace

// The one list of settings. A new setting is one row in one of the lists
// above (plus its Config member, unless it is a backend's Int or Flag);
// docs/env_vars.md is regenerated from it (a unit test compares).
const std::vector<Setting>& Settings() {
  static const std::vector<Setting> settings = [] {
    std::vector<Setting> all = CoordinatorSettings();
    for (Setting& s : RuntimeSettings()) all.push_back(std::move(s));
    for (Setting& s : DataPathSettings()) all.push_back(std::move(s));
    return all;
  }();
  return settings;
}

const std::vector<ConfigVariable>& ConfigVariables() {
  static const std::vector<ConfigVariable> vars = [] {
    std::vector<ConfigVariable> v;
    for (const Setting& s : Settings()) v.push_back({s.name, s.doc});
    return v;
  }();
  return vars;
}

namespace {

Status ParseInt(const std::string& name, const std::string& v, int64_t lo,
                int64_t* out) {
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || errno != 0 || *end != '\0' || x < lo) {
    return Status::InvalidArgument(
        name + "=\"" + v + "\": expected an integer >= " + std::to_string(lo) +
        ".");
  }
  *out = x;
  return Status::OK();
}

Status ParseFloat(const std::string& name, const std::string& v, double* out) {
  errno = 0;
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || errno != 0 || *end != '\0' || !(x >= 0.0)) {
    return Status::InvalidArgument(name + "=\"" + v +
                                   "\": expected a number >= 0.");
  }
  *out = x;
  return Status::OK();
}

Status ParseBool(const std::string& name, const std::string& v, bool* out) {
  if (v == "1" || v == "true" || v == "True" || v == "yes") {
    *out = true;
  } else if (v == "0" || v == "false" || v == "False" || v == "no" ||
             v.empty()) {
    *out = false;
  } else {
    return Status::InvalidArgument(name + "=\"" + v + "\": expected 0 or 1.");
  }
  return Status::OK();
}

Status ParseString(const Setting& s, const std::string& v, std::string* out) {
  if (s.choices.empty()) {
    *out = v;
    return Status::OK();
  }
  std::string expected;
  for (size_t i = 0; i < s.choices.size(); ++i) {
    if (v == s.choices[i]) {
      *out = v;
      return Status::OK();
    }
    expected += (i == 0                      ? ""
                 : i + 1 == s.choices.size() ? " or "
                                             : ", ") +
                s.choices[i];
  }
  return Status::InvalidArgument(std::string(s.name) + "=\"" + v +
                                 "\": expected " + expected + ".");
}

// Parses `v` into the Config member the row names, by the member's type.
Status Parse(const Setting& s, const std::string& v, Config* c) {
  const std::string name = s.name;
  if (auto f = std::get_if<int64_t Config::*>(&s.field)) {
    return ParseInt(name, v, s.min, &(c->**f));
  }
  if (auto f = std::get_if<int Config::*>(&s.field)) {
    int64_t i = 0;
    KD_RETURN_IF_ERROR(ParseInt(name, v, s.min, &i));
    c->** f = static_cast<int>(i);
    return Status::OK();
  }
  if (auto f = std::get_if<double Config::*>(&s.field)) {
    return ParseFloat(name, v, &(c->**f));
  }
  if (auto f = std::get_if<bool Config::*>(&s.field)) {
    return ParseBool(name, v, &(c->**f));
  }
  if (std::holds_alternative<Setting::Int>(s.field)) {
    return ParseInt(name, v, s.min, &c->given[name]);
  }
  if (std::holds_alternative<Setting::Flag>(s.field)) {
    bool b = false;
    KD_RETURN_IF_ERROR(ParseBool(name, v, &b));
    c->given[name] = b ? 1 : 0;
    return Status::OK();
  }
  if (std::holds_alternative<Setting::Choice>(s.field)) {
    std::string text;
    KD_RETURN_IF_ERROR(ParseString(s, v, &text));
    c->given[name] =
        std::find(s.choices.begin(), s.choices.end(), text) - s.choices.begin();
    return Status::OK();
  }
  return ParseString(s, v, &(c->*std::get<std::string Config::*>(s.field)));
}

const Setting* Find(const std::string& name) {
  for (const Setting& s : Settings()) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

}  // namespace

Status ApplySetting(const std::string& name, const std::string& value,
                    Config* config) {
  const Setting* s = Find(name);
  if (s == nullptr) {
    return Status::InvalidArgument("unknown setting " + name + ".");
  }
  return Parse(*s, value, config);
}

int64_t Config::Int(const std::string& name) const {
  auto it = given.find(name);
  if (it != given.end()) return it->second;
  const Setting* s = Find(name);
  if (s != nullptr) {
    if (auto i = std::get_if<Setting::Int>(&s->field)) return i->default_value;
    if (auto f = std::get_if<Setting::Flag>(&s->field))
      return f->default_value ? 1 : 0;
    if (auto c = std::get_if<Setting::Choice>(&s->field))
      return c->default_index;
  }
  std::fprintf(stderr,
               "kerasdist bug: no setting %s of kind Setting::Int, "
               "Setting::Flag or Setting::Choice in config.cc's table\n",
               name.c_str());
  std::abort();
}

const std::string& Config::Choice(const std::string& name) const {
  const Setting* s = Find(name);
  if (s == nullptr || !std::holds_alternative<Setting::Choice>(s->field)) {
    std::fprintf(stderr,
                 "kerasdist bug: no setting %s of kind Setting::Choice in "
                 "config.cc's table\n",
                 name.c_str());
    std::abort();
  }
  return s->choices.at(static_cast<size_t>(Int(name)));
}

std::string FormatSetting(const Setting& s, const Config& c) {
  std::ostringstream o;
  std::visit(
      [&](auto field) {
        using F = decltype(field);
        if constexpr (std::is_same_v<F, Setting::Int> ||
                      std::is_same_v<F, Setting::Flag>) {
          o << c.Int(s.name);
        } else if constexpr (std::is_same_v<F, Setting::Choice>) {
          o << c.Choice(s.name);
        } else if constexpr (std::is_same_v<std::decay_t<decltype(c.*field)>,
                                            bool>) {
          o << (c.*field ? 1 : 0);
        } else {
          o << c.*field;
        }
      },
      s.field);
  return o.str();
}

std::string FormatConfig(const Config& c) {
  std::string text;
  for (const Setting& s : Settings()) {
    text += std::string(s.name) + "=" + FormatSetting(s, c) + "\n";
  }
  return text;
}

Status LoadConfig(const std::string& overrides, Config* config) {
  Config c;
  for (const Setting& s : Settings()) {
    const char* v = std::getenv(s.name);
    if (v != nullptr) KD_RETURN_IF_ERROR(Parse(s, v, &c));
  }
  std::istringstream in(overrides);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos) {
      return Status::InvalidArgument("malformed setting \"" + line +
                                     "\": expected NAME=VALUE.");
    }
    KD_RETURN_IF_ERROR(
        ApplySetting(line.substr(0, eq), line.substr(eq + 1), &c));
  }
  *config = c;
  return Status::OK();
}

}  // namespace kerasdist::core
