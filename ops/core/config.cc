#include "config.h"

#include <cerrno>
#include <cstdlib>
#include <map>
#include <sstream>

namespace kerasdist::core {

const std::vector<ConfigVariable>& ConfigVariables() {
  static const std::vector<ConfigVariable> vars = {
      {"KERASDIST_FUSION_THRESHOLD",
       "Tensor Fusion buffer size in bytes (integer, default 67108864; 0 "
       "disables fusion)."},
      {"KERASDIST_CYCLE_TIME",
       "Batching window in milliseconds: how long the coordinator may wait "
       "after the first ready tensor for more to fuse (float, default 0)."},
      {"KERASDIST_CACHE_CAPACITY",
       "Response cache entries (integer, default 1024; 0 disables the cache)."},
      {"KERASDIST_STALL_CHECK_TIME_SECONDS",
       "Warn when a tensor has waited this long for some ranks (float, "
       "default 60; 0 disables)."},
      {"KERASDIST_STALL_SHUTDOWN_TIME_SECONDS",
       "Fail every rank when a tensor has waited this long (float, default 0 "
       "= never)."},
      {"KERASDIST_TIMELINE", "Path of a Chrome-trace timeline written by rank 0."},
      {"KERASDIST_TIMELINE_MARK_CYCLES",
       "1 to add a marker for every runtime cycle to the timeline."},
      {"KERASDIST_AUTOTUNE", "1 to tune fusion threshold and cycle time online."},
      {"KERASDIST_AUTOTUNE_LOG", "CSV file recording every autotune sample."},
      {"KERASDIST_GPU_OPERATIONS",
       "NCCL (default) or MPI: how collectives on GPU memory travel."},
      {"KERASDIST_LOG_LEVEL", "0 quiet, 1 warnings (default), 2 debug."},
      {"KERASDIST_SHM_ALLREDUCE",
       "1 (default) to allreduce host tensors through shared memory when "
       "every rank runs on one node; 0 to always use MPI."},
      {"KERASDIST_SHM_ALLREDUCE_MIN_BYTES",
       "Smallest allreduce (bytes, after fusion) that goes through shared "
       "memory (integer, default 16384); smaller ones use MPI."},
      {"KERASDIST_CMA_ALLREDUCE",
       "1 (default) to let the shared-memory allreduce read the other ranks' "
       "tensors in place (cross-memory attach) where the system allows it; 0 "
       "to stage them in shared-memory slots."},
      {"KERASDIST_CMA_MIN_TENSOR_BYTES",
       "Bytes per tensor, on average over a fused batch, from which the "
       "in-place reads are used (integer, default 4096); batches of smaller "
       "tensors go through the shared-memory slots."},
  };
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
    return Status::InvalidArgument(name + "=\"" + v +
                                   "\": expected 0 or 1.");
  }
  return Status::OK();
}

Status Apply(const std::string& name, const std::string& v, Config* c) {
  int64_t i = 0;
  if (name == "KERASDIST_FUSION_THRESHOLD") {
    KD_RETURN_IF_ERROR(ParseInt(name, v, 0, &c->fusion_threshold_bytes));
  } else if (name == "KERASDIST_CYCLE_TIME") {
    KD_RETURN_IF_ERROR(ParseFloat(name, v, &c->cycle_time_ms));
  } else if (name == "KERASDIST_CACHE_CAPACITY") {
    KD_RETURN_IF_ERROR(ParseInt(name, v, 0, &c->cache_capacity));
  } else if (name == "KERASDIST_STALL_CHECK_TIME_SECONDS") {
    KD_RETURN_IF_ERROR(ParseFloat(name, v, &c->stall_check_time_s));
  } else if (name == "KERASDIST_STALL_SHUTDOWN_TIME_SECONDS") {
    KD_RETURN_IF_ERROR(ParseFloat(name, v, &c->stall_shutdown_time_s));
  } else if (name == "KERASDIST_TIMELINE") {
    c->timeline_path = v;
  } else if (name == "KERASDIST_TIMELINE_MARK_CYCLES") {
    KD_RETURN_IF_ERROR(ParseBool(name, v, &c->timeline_mark_cycles));
  } else if (name == "KERASDIST_AUTOTUNE") {
    KD_RETURN_IF_ERROR(ParseBool(name, v, &c->autotune));
  } else if (name == "KERASDIST_AUTOTUNE_LOG") {
    c->autotune_log = v;
  } else if (name == "KERASDIST_GPU_OPERATIONS") {
    if (v != "NCCL" && v != "MPI") {
      return Status::InvalidArgument(name + "=\"" + v +
                                     "\": expected NCCL or MPI.");
    }
    c->gpu_operations = v;
  } else if (name == "KERASDIST_SHM_ALLREDUCE") {
    KD_RETURN_IF_ERROR(ParseBool(name, v, &c->shm_allreduce));
  } else if (name == "KERASDIST_CMA_ALLREDUCE") {
    KD_RETURN_IF_ERROR(ParseBool(name, v, &c->cma_allreduce));
  } else if (name == "KERASDIST_CMA_MIN_TENSOR_BYTES") {
    KD_RETURN_IF_ERROR(ParseInt(name, v, 0, &c->cma_min_tensor_bytes));
  } else if (name == "KERASDIST_SHM_ALLREDUCE_MIN_BYTES") {
    KD_RETURN_IF_ERROR(ParseInt(name, v, 0, &c->shm_allreduce_min_bytes));
  } else if (name == "KERASDIST_LOG_LEVEL") {
    KD_RETURN_IF_ERROR(ParseInt(name, v, 0, &i));
    c->log_level = static_cast<int>(i);
  } else {
    return Status::InvalidArgument("unknown setting " + name + ".");
  }
  return Status::OK();
}

}  // namespace

Status LoadConfig(const std::string& overrides, Config* config) {
  Config c;
  for (const auto& var : ConfigVariables()) {
    const char* v = std::getenv(var.name);
    if (v != nullptr) KD_RETURN_IF_ERROR(Apply(var.name, v, &c));
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
    KD_RETURN_IF_ERROR(Apply(line.substr(0, eq), line.substr(eq + 1), &c));
  }
  *config = c;
  return Status::OK();
}

}  // namespace kerasdist::core
