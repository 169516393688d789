// The single-node and hierarchical backends (cma, shm, adasum, hier) with
// ranks as threads: each rank makes the runtime's backend list (MakeBackends)
// over in-process communicators (every rank's, its host's, the hosts'
// leaders'), each batch goes to the backend the list chooses, which must be
// the one under test, and every rank's outputs are checked against the
// serial reference (reduce_cases.h): every dtype (float16 and bfloat16
// included), sum, min, max, product, Average as the runtime sends it, the
// scale factors, fused and single tensors, odd counts, and sizes past the
// in-place path's chunk. Threads of one process share its memory, so the
// shared-memory slots and the in-place reads (process_vm_readv of this
// process) run as they do between processes.
#include <cfloat>
#include <cmath>
#include <functional>
#include <memory>

#include "../core/backends/backends.h"
#include "harness.h"
#include "reduce_cases.h"
#include "values.h"

namespace kdtest {
namespace {

// The list as the runtime makes it on this rank.
BackendList MakeList(const Config& config, const HostRanks& r) {
  NodeContext ctx;
  ctx.comm = r.comm;
  ctx.node = r.node;
  ctx.leaders = r.leaders;
  BackendList list;
  CHECK_OK(MakeBackends(config, ctx, &list));
  return list;
}

// The defaults, then `lines` ("NAME=value" each) as the runtime parses them
// (not the environment's).
Config Parsed(const std::string& lines) {
  Config c;
  size_t at = 0;
  while (at < lines.size()) {
    size_t end = lines.find('\n', at), eq = lines.find('=', at);
    if (end == std::string::npos) end = lines.size();
    CHECK(eq < end);
    CHECK_OK(ApplySetting(lines.substr(at, eq - at),
                          lines.substr(eq + 1, end - eq - 1), &c));
    at = end + 1;
  }
  return c;
}

// Every size: the single-node minimums at 0, so that small batches take the
// paths under test too; `more`: further settings.
Config AllSizes(const std::string& more = "") {
  return Parsed(
      "KERASDIST_SHM_ALLREDUCE_MIN_BYTES=0\n"
      "KERASDIST_CMA_MIN_TENSOR_BYTES=0\n" +
      more);
}

// The reference's cases, and larger ones: odd counts past the in-place
// path's 256 KiB chunk, fused and alone.
std::vector<ReduceCase> Cases(int n) {
  std::vector<ReduceCase> cases = AllreduceCases(n);
  for (DataType dt :
       {DataType::kFloat16, DataType::kFloat32, DataType::kInt64}) {
    const bool fl = IsFloat(dt);
    for (const std::vector<int64_t>& counts :
         std::vector<std::vector<int64_t>>{{100003}, {70001, 3, 40013}}) {
      cases.push_back({dt, ReduceOp::kSum, 1.0, 1.0, 1, false, counts});
      const ReduceCase avg{
          dt,         ReduceOp::kSum, 1.0,   fl ? 1.0 / n : 1.0,
          fl ? 1 : n, true,           counts};
      cases.push_back(avg);
    }
  }
  return cases;
}

// Which single-node backend the list gives case `c`: the slots and the
// in-place reads take the reductions of every dtype but bytes and booleans;
// in-place reads, where on, take those with no prescale.
std::string SingleNodeChoice(const ReduceCase& c, bool cma) {
  int64_t total = 0;
  for (int64_t n : c.counts) total += n;
  if (total == 0 || c.dt == DataType::kUInt8 || c.dt == DataType::kBool)
    return "mpi";
  return cma && c.pre == 1.0 ? "cma" : "shm";
}

// Runs every case of Cases(n) through the list; `expect` names the backend
// each must reach.
void RunCases(const BackendList& list, int rank, int n,
              const std::function<std::string(const ReduceCase&)>& expect) {
  for (const ReduceCase& c : Cases(n)) {
    AllreduceRun run;
    PrepareAllreduce(c, rank, &run);
    Backend* chosen = ChooseBackend(list, run.batch);
    CHECK(chosen != nullptr);
    const std::string want = expect(c);
    CHECK_MSG(want == chosen->Name(), c.Describe() + ": the list chose " +
                                          chosen->Name() + ", not " + want);
    CHECK_OK(chosen->Run(run.batch, 0));
    CHECK_MSG(want == run.batch.backend,
              c.Describe() + ": ran on " + run.batch.backend);
    CheckAllreduce(c, n, run);
  }
}

KD_TEST(CmaAllreduceMatchesTheReference) {
  for (int n : {2, 3}) {
    RunHosts({n}, [&](HostRanks& r) {
      const BackendList list = MakeList(AllSizes(), r);
      RunCases(list, r.comm->rank(), n,
               [](const ReduceCase& c) { return SingleNodeChoice(c, true); });
    });
  }
}

KD_TEST(ShmAllreduceMatchesTheReference) {
  const Config config = AllSizes("KERASDIST_CMA_ALLREDUCE=0");
  for (int n : {2, 3, 4}) {
    RunHosts({n}, [&](HostRanks& r) {
      const BackendList list = MakeList(config, r);
      RunCases(list, r.comm->rank(), n,
               [](const ReduceCase& c) { return SingleNodeChoice(c, false); });
    });
  }
}

// Settings differ between ranks: the list must not (one rank's 0 turns a
// path off for all), and a job on several hosts has no single-node path.
KD_TEST(SingleNodeBackendsNeedEveryRankAndOneNode) {
  RunHosts({3}, [&](HostRanks& r) {
    const Config config =
        AllSizes(r.comm->rank() == 1 ? "KERASDIST_CMA_ALLREDUCE=0"
                                     : "KERASDIST_CMA_ALLREDUCE=1");
    std::vector<std::string> names;
    for (const auto& b : MakeList(config, r)) names.push_back(b->Name());
    CHECK(names == (std::vector<std::string>{"self", "adasum", "shm", "mpi"}));
  });
  RunHosts({2, 2}, [&](HostRanks& r) {
    const Config config = AllSizes(
        "KERASDIST_HIERARCHICAL_ALLREDUCE=0\n"
        "KERASDIST_HIERARCHICAL_ALLGATHER=0");
    std::vector<std::string> names;
    for (const auto& b : MakeList(config, r)) names.push_back(b->Name());
    CHECK(names == (std::vector<std::string>{"self", "adasum", "mpi"}));
  });
}

// The shared-memory slots' reducescatter and allgather.
KD_TEST(ShmReducescatterAndAllgather) {
  const Config config = AllSizes("KERASDIST_CMA_ALLREDUCE=0");
  for (int n : {2, 3}) {
    RunHosts({n}, [&](HostRanks& r) {
      const BackendList list = MakeList(config, r);
      const int me = r.comm->rank();
      for (DataType dt : {DataType::kFloat16, DataType::kInt32}) {
        for (int64_t base : {1, 7, 50001}) {
          // Rank k's part: base + k elements (odd and uneven).
          ReduceCase c{dt, ReduceOp::kSum, 1.0, IsFloat(dt) ? 0.5 : 1.0};
          int64_t total = 0, offset = 0;
          for (int k = 0; k < n; ++k) {
            c.counts.push_back(base + k);
            if (k < me) offset += base + k;
            total += base + k;
          }
          std::vector<char> in(total * Size(dt)), out(c.counts[me] * Size(dt));
          for (int64_t i = 0; i < total; ++i)
            Put(in, i, dt, Value(me, 0, i, dt));
          const std::string name = "rs";
          CollectiveBatch b;
          b.op = OpType::kReducescatter;
          b.dtype = dt;
          b.postscale = c.post;
          b.counts.assign(c.counts.begin(), c.counts.end());
          b.tensors.push_back({&name, in.data(), out.data(), total});
          CHECK(std::string(ChooseBackend(list, b)->Name()) == "shm");
          CHECK_OK(ChooseBackend(list, b)->Run(b, 0));
          for (int64_t i = 0; i < c.counts[me]; ++i) {
            const double want = Expected(c, n, 0, offset + i);
            CHECK_MSG(std::fabs(Get(out, i, dt) - want) <=
                          Tolerance(dt) * std::max(1.0, std::fabs(want)),
                      "reducescatter " + c.Describe() + " element " +
                          std::to_string(i));
          }
          // Allgather: each rank's part of `in`, bytes as they are.
          CollectiveBatch g;
          g.op = OpType::kAllgather;
          g.dtype = dt;
          for (int64_t k : c.counts) g.recv_bytes.push_back(k * Size(dt));
          std::vector<char> all(total * Size(dt));
          g.tensors.push_back({&name, in.data(), all.data(), c.counts[me]});
          CHECK(std::string(ChooseBackend(list, g)->Name()) == "shm");
          CHECK_OK(ChooseBackend(list, g)->Run(g, 0));
          int64_t at = 0;
          for (int k = 0; k < n; ++k) {
            for (int64_t i = 0; i < c.counts[k]; ++i, ++at) {
              CHECK_MSG(Get(all, at, dt) == Value(k, 0, i, dt),
                        "allgather element " + std::to_string(at));
            }
          }
        }
      }
    });
  }
}

void HierarchicalAllreduce(
    const std::function<void(const std::vector<int>&,
                             const std::function<void(HostRanks&)>&)>& run) {
  for (bool cma : {true, false}) {
    const Config config = AllSizes(cma ? "KERASDIST_CMA_ALLREDUCE=1"
                                       : "KERASDIST_CMA_ALLREDUCE=0");
    for (const std::vector<int>& hosts :
         std::vector<std::vector<int>>{{2, 2}, {3, 1}, {1, 2}}) {
      int n = 0;
      for (int h : hosts) n += h;
      run(hosts, [&](HostRanks& r) {
        const BackendList list = MakeList(config, r);
        RunCases(list, r.comm->rank(), n,
                 [](const ReduceCase&) { return "hier"; });
      });
    }
  }
}

KD_TEST(HierarchicalAllreduceMatchesTheReference) {
  HierarchicalAllreduce(
      [](const auto& hosts, const auto& fn) { RunHosts(hosts, fn); });
}

// The same over the TCP transport: the leaders' and the job's
// communicators are views of one mesh.
KD_TEST(HierarchicalAllreduceOverTcp) {
  HierarchicalAllreduce(
      [](const auto& hosts, const auto& fn) { RunTcpHosts(hosts, fn); });
}

KD_TEST(HierarchicalAllgatherKeepsRankOrder) {
  RunHosts({2, 1, 3}, [&](HostRanks& r) {
    const BackendList list = MakeList(AllSizes(), r);
    const int me = r.comm->rank(), n = r.comm->size();
    for (int64_t base : {0, 5, 1001}) {
      std::vector<int64_t> bytes;
      int64_t total = 0;
      for (int k = 0; k < n; ++k) {
        bytes.push_back((base + (k * 3) % 4) * 8);
        total += bytes.back();
      }
      std::vector<char> in(bytes[me]), out(total);
      for (int64_t i = 0; i < bytes[me] / 8; ++i)
        Put(in, i, DataType::kFloat64, me * 10000 + i);
      const std::string name = "ag";
      CollectiveBatch b;
      b.op = OpType::kAllgather;
      b.dtype = DataType::kFloat64;
      b.recv_bytes.assign(bytes.begin(), bytes.end());
      b.tensors.push_back({&name, in.data(), out.data(), bytes[me] / 8});
      CHECK(std::string(ChooseBackend(list, b)->Name()) == "hier");
      CHECK_OK(ChooseBackend(list, b)->Run(b, 0));
      int64_t at = 0;
      for (int k = 0; k < n; ++k) {
        for (int64_t i = 0; i < bytes[k] / 8; ++i, ++at) {
          CHECK_MSG(Get(out, at, DataType::kFloat64) == k * 10000 + i,
                    "element " + std::to_string(at) + " of base " +
                        std::to_string(base));
        }
      }
    }
  });
}

// Adasum of two vectors, as Horovod defines it, in double.
std::vector<double> AdasumPair(const std::vector<double>& a,
                               const std::vector<double>& b) {
  double dot = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    dot += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  const double tiny = std::sqrt(DBL_MIN);
  const double ac = aa >= tiny ? 1.0 - dot / aa * 0.5 : 1.0;
  const double bc = bb >= tiny ? 1.0 - dot / bb * 0.5 : 1.0;
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = ac * a[i] + bc * b[i];
  return out;
}

// Tensor t of the Adasum over n ranks: pairs of neighbours, then pairs of
// pairs, and so on (the tree the backend walks, whole tensors at a time).
std::vector<double> AdasumReference(int n, int t, int64_t count, DataType dt,
                                    double pre) {
  std::vector<std::vector<double>> v(n);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i)
      v[r].push_back(Value(r, t, i * 5 + r, dt) * pre);
  }
  for (int level = 1; level < n; level <<= 1) {
    for (int r = 0; r < n; r += 2 * level)
      v[r] = AdasumPair(v[r], v[r + level]);
  }
  return v[0];
}

KD_TEST(AdasumMatchesTheReference) {
  // The backend rounds to the dtype at each level (float16 in float, as
  // Horovod's vector path): the tolerance is a few roundings of the dtype.
  const std::pair<DataType, double> types[] = {{DataType::kFloat16, 1e-2},
                                               {DataType::kFloat32, 1e-5},
                                               {DataType::kFloat64, 1e-12}};
  for (int n : {2, 4}) {
    RunHosts({n}, [&](HostRanks& r) {
      const BackendList list = MakeList(AllSizes(), r);
      const int me = r.comm->rank();
      for (const auto& [dt, tol] : types) {
        for (const std::vector<int64_t>& counts :
             std::vector<std::vector<int64_t>>{{1}, {7, 33, 2}, {1001}}) {
          for (double pre : {1.0, 0.5}) {
            std::vector<std::vector<char>> bufs;
            std::vector<std::string> names;
            for (size_t t = 0; t < counts.size(); ++t) {
              bufs.emplace_back(counts[t] * Size(dt));
              names.push_back("t" + std::to_string(t));
              for (int64_t i = 0; i < counts[t]; ++i)
                Put(bufs[t], i, dt, Value(me, t, i * 5 + me, dt));
            }
            CollectiveBatch b;
            b.dtype = dt;
            b.reduce_op = ReduceOp::kAdasum;
            b.prescale = pre;
            b.postscale = 1.0 / n;
            for (size_t t = 0; t < counts.size(); ++t)
              b.tensors.push_back(
                  {&names[t], bufs[t].data(), bufs[t].data(), counts[t]});
            CHECK(std::string(ChooseBackend(list, b)->Name()) == "adasum");
            CHECK_OK(ChooseBackend(list, b)->Run(b, 0));
            for (size_t t = 0; t < counts.size(); ++t) {
              const std::vector<double> want =
                  AdasumReference(n, t, counts[t], dt, pre);
              for (int64_t i = 0; i < counts[t]; ++i) {
                const double w = want[i] / n, have = Get(bufs[t], i, dt);
                CHECK_MSG(
                    std::fabs(have - w) <= tol * std::max(1.0, std::fabs(w)),
                    std::string(DataTypeName(dt)) + " tensor " +
                        std::to_string(t) + "[" + std::to_string(i) + "] is " +
                        std::to_string(have) + ", expected " +
                        std::to_string(w));
              }
            }
          }
        }
      }
    });
  }
}

}  // namespace
}  // namespace kdtest
