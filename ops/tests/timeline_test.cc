// The timeline (core/timeline.h) in one process: a long job that names a
// new tensor at every step keeps a bounded number of rows.
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "../core/timeline.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

size_t Count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos;
       at = text.find(part, at + part.size())) {
    ++n;
  }
  return n;
}

std::string Record(int max_rows, int tensors, size_t* rows) {
  const std::string path =
      "/tmp/kerasdist_timeline_test_" + std::to_string(getpid()) + ".json";
  {
    std::shared_ptr<Timeline> t;
    CHECK_OK(Timeline::Open(path, false, &t));
    if (max_rows > 0) t->set_max_rows(max_rows);
    const auto now = Timeline::Clock::now();
    for (int i = 0; i < tensors; ++i) {
      const std::string name = "allreduce.noname." + std::to_string(i);
      t->Phase(name, kNegotiatePhase, now, now, "\"bytes\":4");
      t->Phase(name, kQueuePhase, now, now);
    }
    *rows = t->rows();
  }  // flushed and closed
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  unlink(path.c_str());
  return text.str();
}

KD_TEST(TimelineRowsAreBoundedForUniqueNames) {
  size_t rows = 0;
  const std::string text = Record(8, 1000, &rows);
  CHECK_MSG(rows == 9, std::to_string(rows));
  // 8 named rows and one shared by the other 992 tensors.
  CHECK(Count(text, "\"thread_name\"") == 9);
  CHECK_CONTAINS(text, "other tensors (a row each for the first 8");
  CHECK_CONTAINS(text, "\"tid\":9,\"ts\":");
  // Each of their events still names its tensor, with its own args.
  CHECK_CONTAINS(text,
                 "\"args\":{\"tensor\":\"allreduce.noname.999\","
                 "\"bytes\":4}");
  CHECK_CONTAINS(text, "\"args\":{\"tensor\":\"allreduce.noname.999\"}");
  CHECK(Count(text, "\"ph\":\"X\"") == 2000);
  CHECK(text.size() > 2 && text.substr(text.size() - 2) == "\n]");
  // The default bound.
  Record(0, Timeline::kMaxRows + 500, &rows);
  CHECK(rows == Timeline::kMaxRows + 1);
}

KD_TEST(TensorLabelsAreBounded) {
  for (size_t i = 0; i < kMaxTensorLabels + 100; ++i) {
    SetTensorLabel("labelled." + std::to_string(i), "w");
  }
  CHECK(TensorLabelCount() == kMaxTensorLabels);
  SetTensorLabel("labelled.0", "relabelled");  // a known one still changes
  CHECK(TensorLabelCount() == kMaxTensorLabels);
}

}  // namespace
}  // namespace kdtest
