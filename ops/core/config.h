// The runtime's settings. config.cc is the only place that reads KERASDIST_*
// environment variables; init(...) keyword arguments arrive as overrides in the
// same KEY=VALUE form and win over the environment.
//
// Settings() is the one table of them: the name, the Config field it sets, how
// its value is parsed, its default (the Config member's initial value) and a
// doc line. Parsing, the list of names, current_settings() and
// docs/env_vars.md all come from it (the C API hands it to Python).
//
// A backend's own setting needs no Config member: its row's field is a
// Setting::Flag or Setting::Int holding the default, and the backend's
// factory reads it by name (config.Flag("KERASDIST_SHM_ALLREDUCE")), so a
// backend with a setting is its file, its line in the backend list and the
// setting's row.
#ifndef KERASDIST_CORE_CONFIG_H_
#define KERASDIST_CORE_CONFIG_H_

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "status.h"

namespace kerasdist::core {

struct Config {
  int64_t fusion_threshold_bytes = 64 * 1024 * 1024;
  double cycle_time_ms = 0.0;  // batching window after the first ready tensor
  int64_t cache_capacity =
      1024;  // response cache entries; 0 disables the cache
  double stall_check_time_s = 60.0;  // warn about tensors missing on some ranks
  double stall_shutdown_time_s = 0.0;  // 0 = never fail a stalled job
  // Every rank blocked on collectives no other rank submitted: end the job
  // after this long. 0 = never.
  double deadlock_shutdown_time_s = 60.0;
  double heartbeat_timeout_s =
      30.0;  // a peer silent this long is lost; 0 = off
  double heartbeat_interval_s = 1.0;  // how often the ranks say they are alive
  std::string
      network_interface;      // rank 0's heartbeat address comes from it first
  std::string timeline_path;  // empty = no timeline
  bool timeline_mark_cycles = false;
  bool autotune = false;
  std::string autotune_log;
  int log_level = 1;            // 0 quiet, 1 warnings, 2 debug
  int64_t restart_attempt = 0;  // set by the launcher; read by the Trainer

  // The value of the setting `name` whose row has no member (Setting::Int,
  // Setting::Flag): as given, else the row's default. A name with no such
  // row is a kerasdist bug: it aborts, naming it.
  int64_t Int(const std::string& name) const;
  bool Flag(const std::string& name) const { return Int(name) != 0; }
  // The value of the setting `name` whose row is a Setting::Choice: one of
  // its choices (aborts, as Int, for a name with no such row).
  const std::string& Choice(const std::string& name) const;
  // Those settings' values as given, by name (booleans 0 or 1).
  std::map<std::string, int64_t> given;
};

// One row of the settings table. `field` says which Config member the setting
// sets (or, Int, Flag and Choice, that it has none) and, by its type, how a
// value is parsed: integers (>= `min`), numbers (>= 0), booleans
// (1/true/True/yes or 0/false/False/no/empty) and strings (one of `choices`
// when there are any, else free text).
struct Setting {
  // A setting with no Config member (a backend's own), and its default:
  // read with Config::Int, Config::Flag or Config::Choice.
  struct Int {
    int64_t default_value;
  };
  struct Flag {
    bool default_value;
  };
  // One of the row's `choices`, the `default_index`-th unless given: read
  // with Config::Choice (held in `given` as its index).
  struct Choice {
    int64_t default_index;
  };
  using Field =
      std::variant<int64_t Config::*, int Config::*, double Config::*,
                   bool Config::*, std::string Config::*, Int, Flag, Choice>;
  const char* name;  // the environment variable, KERASDIST_...
  const char* key;   // its short name (Python: init()'s keyword, if any)
  bool in_init;      // init() takes `key` as a keyword argument
  Field field;
  int64_t min;                       // integers only
  std::vector<std::string> choices;  // strings only; empty = any text
  const char* doc;                   // one line for docs/env_vars.md
};

// Every setting the runtime understands, in docs/env_vars.md's order.
const std::vector<Setting>& Settings();

// Kept for existing callers: the (name, doc) pairs of Settings().
struct ConfigVariable {
  const char* name;
  const char* meaning;
};
const std::vector<ConfigVariable>& ConfigVariables();

// Builds the configuration from the environment, then applies `overrides`
// ("KERASDIST_X=value" lines). A malformed value fails and names the variable.
Status LoadConfig(const std::string& overrides, Config* config);

// Parses one value into `config` as LoadConfig would (unknown names fail).
Status ApplySetting(const std::string& name, const std::string& value,
                    Config* config);

// The value of `setting` in `config` as current_settings() reports it:
// integers and numbers as C++ streams print them, booleans as 1 or 0.
std::string FormatSetting(const Setting& setting, const Config& config);

// "NAME=value" lines of every setting, in table order.
std::string FormatConfig(const Config& config);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_CONFIG_H_
