// The runtime's protocol in miniature, ranks as threads: each rank submits
// its tensors in its own random order and pace, the ranks' messages reach
// rank 0's Coordinator, its decision is broadcast, and every rank executes it
// with CommunicatorBackend over the in-process communicator, keeping its
// response cache in lock-step. Checks: every rank runs the same batches, the
// second step runs from the cache, and every result matches a serial
// reference.
#include <algorithm>
#include <cmath>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "../core/backends/communicator_backend.h"
#include "../core/controller.h"
#include "../core/layout.h"
#include "../core/scale.h"
#include "harness.h"
#include "values.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

struct Tensor {
  Request req;
  std::vector<char> in, out;
};

Request Make(const std::string& name, OpType op, DataType dt, ReduceOp rop,
             std::vector<int64_t> shape) {
  Request q;
  q.name = name;
  q.op = op;
  q.dtype = dt;
  q.reduce_op = rop;
  q.shape = std::move(shape);
  return q;
}

// Rank `rank`'s requests (the same on every rank but allgather's rows).
std::vector<Request> Requests(int rank, int n) {
  const OpType ar = OpType::kAllreduce;
  std::vector<Request> qs = {
      Make("a", ar, DataType::kFloat32, ReduceOp::kSum, {5}),
      Make("b", ar, DataType::kFloat32, ReduceOp::kAverage, {17}),
      Make("c", ar, DataType::kInt32, ReduceOp::kSum, {3}),
      Make("d", ar, DataType::kFloat32, ReduceOp::kSum, {0}),
      Make("e", ar, DataType::kFloat64, ReduceOp::kMax, {9}),
      Make("h", ar, DataType::kInt32, ReduceOp::kAverage, {6}),
      Make("f", ar, DataType::kFloat32, ReduceOp::kSum, {40}),
      Make("gather", OpType::kAllgather, DataType::kFloat32, ReduceOp::kSum,
           {rank + 1, 2}),
      Make("bcast", OpType::kBroadcast, DataType::kInt64, ReduceOp::kSum, {4})};
  qs.back().root_rank = n - 1;
  return qs;
}

// The value tensor `t` of step `step` holds on `rank` at element i.
double Val(int rank, int t, int step, int64_t i, DataType dt) {
  return Value(rank, t + 10 * step, i, dt);
}

std::vector<Tensor> Tensors(int rank, int n, int step) {
  std::vector<Tensor> ts;
  const std::vector<Request> qs = Requests(rank, n);
  for (int t = 0; t < static_cast<int>(qs.size()); ++t) {
    Tensor x{qs[t]};
    const int64_t count = NumElements(x.req.shape);
    x.in.resize(count * Size(x.req.dtype));
    for (int64_t i = 0; i < count; ++i) {
      Put(x.in, i, x.req.dtype, Val(rank, t, step, i, x.req.dtype));
    }
    x.out.assign(x.in.size(), 0);
    ts.push_back(std::move(x));
  }
  return ts;
}

// Checks rank `rank`'s results of one step against plain loops.
void CheckResults(const std::vector<Tensor>& ts, int rank, int n, int step) {
  for (int t = 0; t < static_cast<int>(ts.size()); ++t) {
    const Request& q = ts[t].req;
    const std::vector<char>& out = ts[t].out;
    if (q.op == OpType::kAllgather) {
      int64_t k = 0;
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < (r + 1) * 2; ++i, ++k) {
          CHECK_MSG(Get(out, k, q.dtype) == Val(r, t, step, i, q.dtype),
                    "gather element " + std::to_string(k));
        }
      }
      CHECK(static_cast<int64_t>(out.size()) == k * 4);
      continue;
    }
    for (int64_t i = 0; i < NumElements(q.shape); ++i) {
      double want = Val(q.root_rank, t, step, i, q.dtype);  // broadcast
      if (q.op == OpType::kAllreduce) {
        want = Val(0, t, step, i, q.dtype);
        for (int r = 1; r < n; ++r) {
          const double v = Val(r, t, step, i, q.dtype);
          want = q.reduce_op == ReduceOp::kMax ? std::max(want, v) : want + v;
        }
        if (q.reduce_op == ReduceOp::kAverage) {
          want = IsFloat(q.dtype) ? want / n : std::trunc(want / n);
        }
      }
      const double got = Get(out, i, q.dtype);
      CHECK_MSG(std::fabs(got - want) <= 1e-6 * std::max(1.0, std::fabs(want)),
                q.name + "[" + std::to_string(i) + "] on rank " +
                    std::to_string(rank) + " is " + std::to_string(got) +
                    ", expected " + std::to_string(want));
    }
  }
}

// Runs one decided batch on this rank, as the runtime prepares it.
void RunBatch(Backend& backend, const std::vector<const Response*>& resps,
              std::vector<Tensor>& ts, int n) {
  const Response& head = *resps[0];
  CHECK_MSG(head.error.empty(), head.error);
  auto mine = [&](const std::string& name) -> Tensor& {
    auto it = std::find_if(ts.begin(), ts.end(),
                           [&](const Tensor& t) { return t.req.name == name; });
    CHECK_MSG(it != ts.end(), "unknown tensor " + name);
    return *it;
  };
  CollectiveBatch b;
  b.op = head.req.op;
  b.dtype = head.req.dtype;
  b.root_rank = head.req.root_rank;
  const Scaling s =
      AverageAsSum(head.req.reduce_op, b.dtype, head.req.postscale, n);
  b.reduce_op = s.op;
  b.postscale = s.post;
  b.divisor = s.divisor;
  b.prescale = head.req.prescale;
  for (const Response* r : resps) {
    Tensor& t = mine(r->req.name);
    if (b.op == OpType::kAllgather) {
      const Layout l = AllgatherLayout(*r, t.req);
      t.out.assign(NumElements(l.out_shape) * Size(b.dtype), 0);
      b.recv_bytes = l.recv_bytes;
    }
    b.tensors.push_back(
        {&t.req.name, t.in.data(), t.out.data(), NumElements(t.req.shape)});
  }
  CHECK_OK(backend.Run(b, 0));
}

// Every rank's message to every rank (rank 0 needs them: an allgather).
std::vector<RankMessage> Exchange(Communicator& comm, const RankMessage& m) {
  const int n = comm.size();
  const std::string bytes = Serialize(m);
  int64_t len = static_cast<int64_t>(bytes.size());
  std::vector<int64_t> lens(n);
  CHECK_OK(comm.Allgatherv(&len, lens.data(), std::vector<int64_t>(n, 8)));
  int64_t total = 0;
  for (int64_t l : lens) total += l;
  std::string all(total, '\0');
  CHECK_OK(comm.Allgatherv(bytes.data(), all.data(), lens));
  std::vector<RankMessage> out(n);
  int64_t off = 0;
  for (int r = 0; r < n; ++r) {
    CHECK_OK(Deserialize(all.substr(off, lens[r]), &out[r]));
    off += lens[r];
  }
  return out;
}

CoordinatorMessage BroadcastDecision(Communicator& comm,
                                     const std::string& bytes) {
  int64_t len = static_cast<int64_t>(bytes.size());
  CHECK_OK(comm.Broadcast(&len, 8, 0));
  std::string got = bytes;
  got.resize(len);
  CHECK_OK(comm.Broadcast(got.data(), len, 0));
  CoordinatorMessage m;
  CHECK_OK(Deserialize(got, &m));
  return m;
}

// One rank's state across the steps of a run.
struct RankState {
  Communicator& comm;
  CommunicatorBackend backend;
  ResponseCache cache{64};
  Coordinator coord;  // used on rank 0 only
  std::mt19937 rng;
  std::vector<std::string> log;  // the batches run, by names

  RankState(Communicator& c, const Config& config, unsigned seed)
      : comm(c),
        backend(c.Name().c_str(), &c, c.rank()),
        coord(c.size(), config),
        rng(seed) {}
};

// This rank's next message: up to two of its tensors in its own order.
RankMessage NextMessage(RankState& st, const std::vector<Tensor>& ts,
                        const std::vector<int>& order, size_t* next) {
  RankMessage m;
  for (unsigned k = st.rng() % 3; k > 0 && *next < order.size(); --k) {
    const Request& q = ts[order[(*next)++]].req;
    const int ci = st.cache.Lookup(q, st.comm.rank(), st.comm.size());
    if (ci >= 0) {
      m.cached.push_back(ci);
    } else {
      m.requests.push_back(q);
    }
  }
  return m;
}

// Executes rank 0's decision as every rank does; returns the tensors run.
size_t Execute(RankState& st, const CoordinatorMessage& d,
               std::vector<Tensor>& ts) {
  size_t executed = 0;
  for (const Batch& batch : d.batches) {
    std::vector<const Response*> resps;
    std::string line;
    for (size_t i = 0; i < batch.cache_index.size(); ++i) {
      resps.push_back(batch.cache_index[i] >= 0
                          ? &st.cache.Get(batch.cache_index[i])
                          : &batch.responses[i]);
      line += resps.back()->req.name + " ";
    }
    RunBatch(st.backend, resps, ts, st.comm.size());
    for (size_t i = 0; i < batch.cache_index.size(); ++i) {
      if (batch.cache_index[i] < 0) st.cache.Put(batch.responses[i]);
    }
    executed += resps.size();
    st.log.push_back(line);
  }
  return executed;
}

// One training step: rounds of report, decide, execute until every tensor
// ran; returns how many of this rank's reports were cache indices.
size_t RunStep(RankState& st, int step) {
  const int me = st.comm.rank(), n = st.comm.size();
  std::vector<Tensor> ts = Tensors(me, n, step);
  std::vector<int> order(ts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::shuffle(order.begin(), order.end(), st.rng);
  size_t next = 0, executed = 0, cached = 0;
  while (executed < ts.size()) {
    const RankMessage m = NextMessage(st, ts, order, &next);
    cached += m.cached.size();
    if (st.rng() % 4 == 0)
      std::this_thread::sleep_for(std::chrono::microseconds(st.rng() % 100));
    const std::vector<RankMessage> all = Exchange(st.comm, m);
    std::string decision;
    if (me == 0) {
      for (int r = 0; r < n; ++r) st.coord.Add(r, all[r], st.cache);
      decision = Serialize(st.coord.Decide(st.cache));
    }
    executed += Execute(st, BroadcastDecision(st.comm, decision), ts);
  }
  CHECK(next == order.size());
  CheckResults(ts, me, n, step);
  return cached;
}

// Two steps of every seed at n ranks under `run` (threads over the local
// communicator, or over TCP): every rank runs the same batches, the second
// step from the cache; returns how many batches fused.
int NegotiatedSteps(
    int n, int seeds,
    const std::function<void(int, const std::function<void(Communicator&)>&)>&
        run) {
  int fused = 0;
  Config config;
  config.fusion_threshold_bytes = 128;  // some tensors fuse, some do not
  for (unsigned seed = 0; seed < static_cast<unsigned>(seeds); ++seed) {
    std::vector<std::vector<std::string>> logs(n);
    run(n, [&](Communicator& comm) {
      RankState st(comm, config, seed * 131 + comm.rank());
      RunStep(st, 0);
      // The second step's requests equal the first's: all from the cache.
      const size_t cached = RunStep(st, 1);
      CHECK_MSG(cached == Requests(comm.rank(), n).size(),
                std::to_string(cached) + " cached");
      logs[comm.rank()] = st.log;
    });
    for (int r = 1; r < n; ++r) {
      CHECK_MSG(logs[r] == logs[0],
                "rank " + std::to_string(r) + " ran other batches");
    }
    for (const std::string& line : logs[0]) {
      fused += std::count(line.begin(), line.end(), ' ') > 1;
    }
  }
  return fused;
}

KD_TEST(NegotiatedStepsOverThreads) {
  int fused = 0;
  for (int n = 1; n <= 4; ++n) {
    fused += NegotiatedSteps(n, 8, [](int n, const auto& fn) {
      RunRanks(n, [&](LocalCommunicator& comm) { fn(comm); });
    });
  }
  CHECK_MSG(fused > 0, "no batch was fused: the test no longer covers fusion");
}

// The same protocol and CommunicatorBackend over the TCP transport's
// sockets (tcp_communicator.h).
KD_TEST(NegotiatedStepsOverTcp) {
  int fused = 0;
  for (int n = 2; n <= 3; ++n) {
    fused += NegotiatedSteps(n, 8, [](int n, const auto& fn) {
      RunTcpRanks(n, [&](TcpCommunicator& comm) { fn(comm); });
    });
  }
  CHECK_MSG(fused > 0, "no batch was fused: the test no longer covers fusion");
}

}  // namespace
}  // namespace kdtest
