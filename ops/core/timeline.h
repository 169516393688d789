// Chrome-trace timeline written by rank 0: one row per tensor with its phases
// (NEGOTIATE, QUEUE, MEMCPY_IN_FUSION_BUFFER, the collective,
// MEMCPY_OUT_FUSION_BUFFER) and optional CYCLE markers.
//
// The background loop only appends compact records (row, phase, times, a
// shared args string) under a mutex; a writer thread formats them as JSON and
// appends them to the file every 200 ms, so the loop does no formatting. After
// every flush the file ends with "]", so it is valid JSON even if the job is
// killed (the next flush overwrites the bracket).
#ifndef KERASDIST_CORE_TIMELINE_H_
#define KERASDIST_CORE_TIMELINE_H_

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "status.h"

namespace kerasdist::core {

// The names of the timeline's events. The collective phases are
// OpPhaseName(op) (types.h). runtime.cc records with these names.
inline constexpr char kNegotiatePhase[] = "NEGOTIATE";
inline constexpr char kQueuePhase[] = "QUEUE";
inline constexpr char kCopyInPhase[] = "MEMCPY_IN_FUSION_BUFFER";
inline constexpr char kCopyOutPhase[] = "MEMCPY_OUT_FUSION_BUFFER";
inline constexpr char kCycleMarker[] = "CYCLE";  // an instant event

// An event name with its role: "negotiate", "queue", "copy_in",
// "collective", "host_in" / "host_out" (a hierarchical allreduce's phases
// within a host, around its cross-host collective), "copy_out" or "marker".
struct TimelinePhase {
  const char* name;
  const char* role;
};
// Every event name the timeline writes, in the order a tensor meets the
// phases (the collectives in OpType order), the cycle marker last. The C API
// hands it to kerasdist/timeline_tools.py.
const std::vector<TimelinePhase>& TimelinePhases();

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;
  static Status Open(const std::string& path, bool mark_cycles,
                     std::shared_ptr<Timeline>* out);
  ~Timeline();  // flushes and closes

  // A complete event on the tensor's row. `phase` must be a string with
  // static storage (a literal). `args` is a JSON object body (without
  // braces), e.g. "\"bytes\":4096".
  void Phase(const std::string& tensor, const char* phase,
             Clock::time_point start, Clock::time_point end,
             const std::string& args = "");
  // The same event on several rows (a fused batch): one lock, one args copy.
  void Phases(const std::vector<const std::string*>& tensors, const char* phase,
              Clock::time_point start, Clock::time_point end,
              const std::string& args);
  void Cycle(Clock::time_point t);
  bool mark_cycles() const { return mark_cycles_; }
  // The rows named so far (the overflow row included).
  size_t rows();

  // A long job may name a new tensor at every step (unnamed eager calls):
  // the first kMaxRows tensors get a row each, the later ones share one
  // more, "other tensors", each event naming its tensor in args.tensor,
  // so that memory stays bounded.
  static constexpr int kMaxRows = 4096;
  // Tests: a smaller bound, before any event.
  void set_max_rows(int n) { max_rows_ = n; }

 private:
  Timeline() = default;
  void WriterLoop();
  void Flush();
  int64_t Micros(Clock::time_point t) const;
  int Row(const std::string& tensor);  // requires mu_

  struct Event {
    int row;  // -1: a cycle marker
    const char* phase;
    int64_t ts, dur;
    std::shared_ptr<const std::string> args;  // null: none
  };

  std::FILE* file_ = nullptr;
  bool mark_cycles_ = false;
  Clock::time_point origin_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closing_ = false;
  std::vector<Event> events_;
  std::vector<std::string> meta_;  // formatted row names
  std::unordered_map<std::string, int> rows_;
  int max_rows_ = kMaxRows;
  int overflow_row_ = 0;  // 0 until needed
  bool wrote_any_ = false;
  std::thread writer_;
};

std::string JsonEscape(const std::string& s);

// A name users recognise for a tensor (a gradient's variable), shown as the
// name of its timeline row; the tensor's own name moves to the row's
// args.tensor. Any thread may set one, at any time: a row takes the label
// its tensor has when the row is first written. Labels are per process;
// rank 0's name the rows, since rank 0 writes the file. At most
// kMaxTensorLabels tensors have one (a new tensor past that keeps its own
// name).
inline constexpr size_t kMaxTensorLabels = 65536;
void SetTensorLabel(const std::string& tensor, const std::string& label);
size_t TensorLabelCount();

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TIMELINE_H_
