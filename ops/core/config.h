// The runtime's settings. config.cc is the only place that reads KERASDIST_*
// environment variables; init(...) keyword arguments arrive as overrides in the
// same KEY=VALUE form and win over the environment.
#ifndef KERASDIST_CORE_CONFIG_H_
#define KERASDIST_CORE_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace kerasdist::core {

struct Config {
  int64_t fusion_threshold_bytes = 64 * 1024 * 1024;
  double cycle_time_ms = 0.0;          // batching window after the first ready tensor
  int64_t cache_capacity = 1024;       // response cache entries; 0 disables the cache
  double stall_check_time_s = 60.0;    // warn about tensors missing on some ranks
  double stall_shutdown_time_s = 0.0;  // 0 = never fail a stalled job
  std::string timeline_path;           // empty = no timeline
  bool timeline_mark_cycles = false;
  bool autotune = false;
  std::string autotune_log;
  std::string gpu_operations = "NCCL";  // NCCL | MPI
  bool shm_allreduce = true;            // shared-memory allreduce on one node
  int64_t shm_allreduce_min_bytes = 16 * 1024;  // smaller ones go to MPI
  bool cma_allreduce = true;            // ... reading peers in place (CMA)
  int64_t cma_min_tensor_bytes = 4096;  // ... for batches with tensors this big on average
  int log_level = 1;                    // 0 quiet, 1 warnings, 2 debug
};

struct ConfigVariable {
  const char* name;
  const char* meaning;
};

// Every variable the runtime understands (docs/env_vars.md is checked against it).
const std::vector<ConfigVariable>& ConfigVariables();

// Builds the configuration from the environment, then applies `overrides`
// ("KERASDIST_X=value" lines). A malformed value fails and names the variable.
Status LoadConfig(const std::string& overrides, Config* config);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_CONFIG_H_
