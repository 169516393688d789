#include "timeline.h"

#include <cerrno>
#include <cstring>

#include "backends/backend.h"
#include "types.h"

namespace kerasdist::core {

const std::vector<TimelinePhase>& TimelinePhases() {
  static const std::vector<TimelinePhase> phases = [] {
    std::vector<TimelinePhase> p = {{kNegotiatePhase, "negotiate"},
                                    {kQueuePhase, "queue"},
                                    {kCopyInPhase, "copy_in"}};
    for (int v = 0; v < kNumOpTypes; ++v) {
      p.push_back({OpPhaseName(static_cast<OpType>(v)), "collective"});
    }
    // A hierarchical allreduce: within the host, across hosts (the
    // collective), back within the host.
    p.push_back({kHierarchicalPhases[0], "host_in"});
    p.push_back({kHierarchicalPhases[1], "collective"});
    p.push_back({kHierarchicalPhases[2], "host_out"});
    p.push_back({kCopyOutPhase, "copy_out"});
    p.push_back({kCycleMarker, "marker"});
    return p;
  }();
  return phases;
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

namespace {

std::mutex& LabelsMutex() {
  static std::mutex mu;
  return mu;
}

std::unordered_map<std::string, std::string>& Labels() {
  static auto* labels = new std::unordered_map<std::string, std::string>();
  return *labels;
}

// The row's display name and its args: the label, if any, with the tensor.
std::string RowArgs(const std::string& tensor) {
  std::lock_guard<std::mutex> lock(LabelsMutex());
  auto it = Labels().find(tensor);
  if (it == Labels().end()) return "\"name\":\"" + JsonEscape(tensor) + "\"";
  return "\"name\":\"" + JsonEscape(it->second) + "\",\"tensor\":\"" +
         JsonEscape(tensor) + "\"";
}

}  // namespace

void SetTensorLabel(const std::string& tensor, const std::string& label) {
  std::lock_guard<std::mutex> lock(LabelsMutex());
  auto it = Labels().find(tensor);
  if (it != Labels().end()) {
    it->second = label;
  } else if (Labels().size() < kMaxTensorLabels) {
    Labels().emplace(tensor, label);
  }
}

size_t TensorLabelCount() {
  std::lock_guard<std::mutex> lock(LabelsMutex());
  return Labels().size();
}

Status Timeline::Open(const std::string& path, bool mark_cycles,
                      std::shared_ptr<Timeline>* out) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return Status::InvalidArgument("cannot write the timeline to '" + path +
                                   "': " + std::strerror(errno));
  }
  std::shared_ptr<Timeline> t(new Timeline());
  t->file_ = f;
  t->mark_cycles_ = mark_cycles;
  t->origin_ = Clock::now();
  t->meta_.push_back(
      "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":0,\"args\":{\"name\":"
      "\"kerasdist rank 0\"}}");
  std::fputs("[\n", f);
  t->writer_ = std::thread(&Timeline::WriterLoop, t.get());
  *out = std::move(t);
  return Status::OK();
}

Timeline::~Timeline() {
  {
    std::lock_guard<std::mutex> l(mu_);
    closing_ = true;
    cv_.notify_all();
  }
  if (writer_.joinable()) writer_.join();
  Flush();
  if (file_ != nullptr) std::fclose(file_);
}

int64_t Timeline::Micros(Clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::microseconds>(t - origin_)
      .count();
}

size_t Timeline::rows() {
  std::lock_guard<std::mutex> l(mu_);
  return rows_.size() + (overflow_row_ ? 1 : 0);
}

int Timeline::Row(const std::string& tensor) {
  auto it = rows_.find(tensor);
  if (it != rows_.end()) return it->second;
  if (static_cast<int>(rows_.size()) >= max_rows_) {
    if (overflow_row_ == 0) {
      overflow_row_ = max_rows_ + 1;
      meta_.push_back(
          "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":0,\"tid\":" +
          std::to_string(overflow_row_) +
          ",\"args\":{\"name\":\"other tensors (a row each for the first " +
          std::to_string(max_rows_) + "; args.tensor names each)\"}}");
    }
    return overflow_row_;
  }
  int row = static_cast<int>(rows_.size()) + 1;  // row 0 holds cycle markers
  rows_.emplace(tensor, row);
  meta_.push_back("{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":0,\"tid\":" +
                  std::to_string(row) + ",\"args\":{" + RowArgs(tensor) + "}}");
  return row;
}

void Timeline::Phase(const std::string& tensor, const char* phase,
                     Clock::time_point start, Clock::time_point end,
                     const std::string& args) {
  Phases({&tensor}, phase, start, end, args);
}

void Timeline::Phases(const std::vector<const std::string*>& tensors,
                      const char* phase, Clock::time_point start,
                      Clock::time_point end, const std::string& args) {
  const int64_t ts = Micros(start);
  const int64_t dur = std::max<int64_t>(Micros(end) - ts, 0);
  std::shared_ptr<const std::string> shared;
  if (!args.empty()) shared = std::make_shared<const std::string>(args);
  std::lock_guard<std::mutex> l(mu_);
  for (const std::string* tensor : tensors) {
    const int row = Row(*tensor);
    if (row != overflow_row_) {
      events_.push_back(Event{row, phase, ts, dur, shared});
      continue;
    }
    // The shared row: each event names its tensor.
    events_.push_back(Event{row, phase, ts, dur,
                            std::make_shared<const std::string>(
                                "\"tensor\":\"" + JsonEscape(*tensor) + "\"" +
                                (args.empty() ? "" : "," + args))});
  }
}

void Timeline::Cycle(Clock::time_point t) {
  std::lock_guard<std::mutex> l(mu_);
  events_.push_back(Event{-1, kCycleMarker, Micros(t), 0, nullptr});
}

void Timeline::WriterLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!closing_) {
    cv_.wait_for(l, std::chrono::milliseconds(200));
    l.unlock();
    Flush();
    l.lock();
  }
}

void Timeline::Flush() {
  std::vector<Event> batch;
  std::vector<std::string> meta;
  {
    std::lock_guard<std::mutex> l(mu_);
    batch.swap(events_);
    meta.swap(meta_);
  }
  if ((batch.empty() && meta.empty()) || file_ == nullptr) return;
  // Overwrite the "]" that closed the previous flush.
  if (wrote_any_) std::fseek(file_, -2, SEEK_END);
  std::string text;
  bool first = !wrote_any_;
  auto add = [&](const std::string& e) {
    if (!first) text += ",\n";
    first = false;
    text += e;
  };
  for (const std::string& m : meta) add(m);
  for (const Event& e : batch) {
    if (e.row < 0) {
      add("{\"ph\":\"i\",\"s\":\"g\",\"name\":\"" + std::string(e.phase) +
          "\",\"pid\":0,\"tid\":0,\"ts\":" + std::to_string(e.ts) + "}");
    } else {
      add("{\"ph\":\"X\",\"name\":\"" + std::string(e.phase) +
          "\",\"pid\":0,\"tid\":" + std::to_string(e.row) + ",\"ts\":" +
          std::to_string(e.ts) + ",\"dur\":" + std::to_string(e.dur) +
          ",\"args\":{" + (e.args ? *e.args : "") + "}}");
    }
  }
  text += "\n]";
  std::fwrite(text.data(), 1, text.size(), file_);
  std::fflush(file_);
  wrote_any_ = true;
}

}  // namespace kerasdist::core
