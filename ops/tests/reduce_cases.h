// The allreduce reference the backends' thread tests share: cases (dtype,
// reduction, scale factors, tensor counts, in place or not), each rank's
// inputs, and the serial truth every rank's outputs must match, computed
// here with plain loops.
#ifndef KERASDIST_OPS_TESTS_REDUCE_CASES_H_
#define KERASDIST_OPS_TESTS_REDUCE_CASES_H_

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../core/backends/backend.h"
#include "../core/scale.h"
#include "harness.h"
#include "values.h"

namespace kdtest {

using namespace kerasdist::core;  // NOLINT: the tests' own namespace

inline const DataType kAllTypes[] = {
    DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
    DataType::kFloat64, DataType::kInt32,    DataType::kInt64,
    DataType::kUInt8,   DataType::kBool,     DataType::kInt8,
    DataType::kInt16,   DataType::kUInt16};

struct ReduceCase {
  DataType dt;
  ReduceOp op;
  double pre = 1.0, post = 1.0;
  int64_t divisor = 1;
  bool in_place = false;
  std::vector<int64_t> counts;

  std::string Describe() const {
    return std::string(DataTypeName(dt)) + " " + ReduceOpName(op) +
           " pre=" + std::to_string(pre) + " post=" + std::to_string(post) +
           " divisor=" + std::to_string(divisor) +
           (in_place ? " in place" : " out of place") + " counts " +
           ShapeString(counts);
  }
};

inline double Fold(double a, double b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return std::min(a, b);
    case ReduceOp::kMax:
      return std::max(a, b);
    case ReduceOp::kProduct:
      return a * b;
    default:
      return a + b;
  }
}

// v as dt holds it: narrow integers wrap, as their arithmetic does.
inline int64_t Wrap(int64_t v, DataType dt) {
  switch (dt) {
    case DataType::kUInt8:
    case DataType::kBool:
      return static_cast<uint8_t>(v);
    case DataType::kInt8:
      return static_cast<int8_t>(v);
    case DataType::kInt16:
      return static_cast<int16_t>(v);
    case DataType::kUInt16:
      return static_cast<uint16_t>(v);
    default:
      return v;
  }
}

// What element i of tensor t must be after the allreduce over n ranks.
inline double Expected(const ReduceCase& c, int n, int t, int64_t i) {
  const bool fl = IsFloat(c.dt);
  double acc = 0;
  for (int r = 0; r < n; ++r) {
    double x = Value(r, t, i, c.dt) * c.pre;
    if (!fl) x = std::trunc(x);  // toward zero, as Horovod
    acc = r == 0 ? x : Fold(acc, x, c.op);
  }
  if (fl) return acc * c.post;
  int64_t v = Wrap(static_cast<int64_t>(acc), c.dt);
  if (c.post == 1.0) {
    if (c.divisor > 1) v /= c.divisor;  // truncates toward zero, as C does
  } else {
    // Horovod's integer scaling: times post / divisor, truncated.
    const double f = c.divisor > 1 ? c.post / c.divisor : c.post;
    v = static_cast<int64_t>(std::trunc(static_cast<double>(v) * f));
  }
  return static_cast<double>(Wrap(v, c.dt));
}

inline double Tolerance(DataType dt) {
  switch (dt) {
    case DataType::kFloat16:
      return 1e-3;
    case DataType::kBFloat16:
      return 8e-3;
    case DataType::kFloat32:
      return 1e-6;
    case DataType::kFloat64:
      return 1e-12;
    default:
      return 0;
  }
}

inline std::vector<ReduceCase> AllreduceCases(int n) {
  const std::vector<std::vector<int64_t>> shapes = {
      {5, 0, 17, 1}, {9}, {0}, {3, 3}};
  std::vector<ReduceCase> out;
  for (DataType dt : kAllTypes) {
    const bool fl = IsFloat(dt);
    std::vector<ReduceCase> kinds;
    for (ReduceOp op :
         {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
      if (dt == DataType::kBool &&
          (op == ReduceOp::kSum || op == ReduceOp::kProduct))
        continue;
      kinds.push_back({dt, op});
    }
    if (dt != DataType::kBool) {
      // Average as the runtime sends it (AverageAsSum), and the scale factors.
      const Scaling avg = AverageAsSum(ReduceOp::kAverage, dt, 1.0, n);
      ReduceCase a{dt, ReduceOp::kSum, 1.0, fl ? 1.0 / n : 1.0, fl ? 1 : n};
      CHECK(avg.op == a.op && avg.post == a.post && avg.divisor == a.divisor);
      kinds.push_back(a);
      kinds.push_back({dt, ReduceOp::kSum, fl ? 0.5 : 2.0, fl ? 2.0 : 3.0});
      kinds.push_back({dt, ReduceOp::kMax, fl ? 0.5 : 2.0, 1.0});
      if (!fl) {
        // Fractional factors truncate toward zero; Average with a postscale
        // is the sum times post / size, truncated.
        kinds.push_back({dt, ReduceOp::kSum, 0.5, 0.75});
        kinds.push_back({dt, ReduceOp::kSum, 1.0, 0.75, n});
      }
    }
    for (const ReduceCase& k : kinds) {
      for (const auto& counts : shapes) {
        for (bool in_place : {false, true}) {
          ReduceCase c = k;
          c.in_place = in_place;
          c.counts = counts;
          out.push_back(c);
        }
      }
    }
  }
  return out;
}

// One rank's tensors of case `c`, and the batch over them.
struct AllreduceRun {
  std::vector<std::vector<char>> inputs, outputs, kept;
  std::vector<std::string> names;
  kerasdist::core::CollectiveBatch batch;
};

// Fills `run` (which must stay where it is: the batch points into it) with
// rank `rank`'s inputs of case `c`.
inline void PrepareAllreduce(const ReduceCase& c, int rank, AllreduceRun* run) {
  using namespace kerasdist::core;
  for (size_t t = 0; t < c.counts.size(); ++t) {
    std::vector<char> in(c.counts[t] * Size(c.dt));
    for (int64_t i = 0; i < c.counts[t]; ++i)
      Put(in, i, c.dt, Value(rank, t, i, c.dt));
    run->inputs.push_back(std::move(in));
    run->outputs.emplace_back(c.counts[t] * Size(c.dt), '\x7f');
    run->names.push_back("t" + std::to_string(t));
  }
  CollectiveBatch& b = run->batch;
  b.op = OpType::kAllreduce;
  b.dtype = c.dt;
  b.reduce_op = c.op;
  b.prescale = c.pre;
  b.postscale = c.post;
  b.divisor = c.divisor;
  for (size_t t = 0; t < c.counts.size(); ++t) {
    void* out = c.in_place ? run->inputs[t].data() : run->outputs[t].data();
    b.tensors.push_back(
        {&run->names[t], run->inputs[t].data(), out, c.counts[t]});
  }
  run->kept = run->inputs;
}

// Checks this rank's outputs of `run` against the reference over n ranks.
inline void CheckAllreduce(const ReduceCase& c, int n,
                           const AllreduceRun& run) {
  for (size_t t = 0; t < c.counts.size(); ++t) {
    const std::vector<char>& got = c.in_place ? run.inputs[t] : run.outputs[t];
    if (!c.in_place)
      CHECK_MSG(run.inputs[t] == run.kept[t], "input changed: " + c.Describe());
    for (int64_t i = 0; i < c.counts[t]; ++i) {
      const double want = Expected(c, n, t, i), have = Get(got, i, c.dt);
      const double tol = Tolerance(c.dt) * std::max(1.0, std::fabs(want));
      CHECK_MSG(std::fabs(have - want) <= tol,
                c.Describe() + ": tensor " + std::to_string(t) + "[" +
                    std::to_string(i) + "] is " + std::to_string(have) +
                    ", expected " + std::to_string(want));
    }
  }
}

// One rank runs case `c` on `backend` and checks its own outputs.
inline void RunAllreduceCase(kerasdist::core::Backend& backend,
                             const ReduceCase& c, int rank, int n) {
  AllreduceRun run;
  PrepareAllreduce(c, rank, &run);
  CHECK_OK(backend.Run(run.batch, 0));
  CHECK(std::string(run.batch.backend) == backend.Name());
  CheckAllreduce(c, n, run);
}

}  // namespace kdtest

#endif  // KERASDIST_OPS_TESTS_REDUCE_CASES_H_
