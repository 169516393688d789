#include "timeline.h"

#include <cerrno>
#include <cstring>

namespace kerasdist::core {

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
  t->events_.push_back(
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
  return std::chrono::duration_cast<std::chrono::microseconds>(t - origin_).count();
}

int Timeline::Row(const std::string& tensor) {
  auto it = rows_.find(tensor);
  if (it != rows_.end()) return it->second;
  int row = static_cast<int>(rows_.size()) + 1;  // row 0 holds cycle markers
  rows_.emplace(tensor, row);
  events_.push_back("{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":0,\"tid\":" +
                    std::to_string(row) + ",\"args\":{\"name\":\"" +
                    JsonEscape(tensor) + "\"}}");
  return row;
}

void Timeline::Phase(const std::string& tensor, const char* phase,
                     Clock::time_point start, Clock::time_point end,
                     const std::string& args) {
  int64_t ts = Micros(start);
  int64_t dur = std::max<int64_t>(Micros(end) - ts, 0);
  std::lock_guard<std::mutex> l(mu_);
  int row = Row(tensor);
  events_.push_back("{\"ph\":\"X\",\"name\":\"" + std::string(phase) +
                    "\",\"pid\":0,\"tid\":" + std::to_string(row) +
                    ",\"ts\":" + std::to_string(ts) + ",\"dur\":" +
                    std::to_string(dur) + ",\"args\":{" + args + "}}");
}

void Timeline::Cycle(Clock::time_point t) {
  std::string e = "{\"ph\":\"i\",\"s\":\"g\",\"name\":\"CYCLE\",\"pid\":0,"
                  "\"tid\":0,\"ts\":" + std::to_string(Micros(t)) + "}";
  std::lock_guard<std::mutex> l(mu_);
  events_.push_back(std::move(e));
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
  std::vector<std::string> batch;
  {
    std::lock_guard<std::mutex> l(mu_);
    batch.swap(events_);
  }
  if (batch.empty() || file_ == nullptr) return;
  // Overwrite the "]" that closed the previous flush.
  if (wrote_any_) std::fseek(file_, -2, SEEK_END);
  std::string text;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (wrote_any_ || i > 0) text += ",\n";
    text += batch[i];
  }
  text += "\n]";
  std::fwrite(text.data(), 1, text.size(), file_);
  std::fflush(file_);
  wrote_any_ = true;
}

}  // namespace kerasdist::core
