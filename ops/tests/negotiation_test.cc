// Negotiation (Coordinator + ResponseCache) driven event by event: the
// orders and timings in which ranks report tensors, chosen by the test.
#include <algorithm>
#include <map>
#include <random>

#include "../core/controller.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

Request Req(const std::string& name, std::vector<int64_t> shape,
            DataType dt = DataType::kFloat32, OpType op = OpType::kAllreduce) {
  Request q;
  q.name = name;
  q.op = op;
  q.dtype = dt;
  q.shape = std::move(shape);
  return q;
}

Config TestConfig(int64_t threshold) {
  Config c;
  c.fusion_threshold_bytes = threshold;
  return c;
}

RankMessage One(const Request& q) {
  RankMessage m;
  m.requests.push_back(q);
  return m;
}

// The tensors of one step: mixed dtypes and sizes (bytes 40..400).
std::vector<Request> Step() {
  return {Req("w0", {10}),
          Req("w1", {100}),
          Req("b0", {10}, DataType::kInt32),
          Req("w2", {30}),
          Req("b1", {20}, DataType::kInt32),
          Req("w3", {1})};
}

struct Event {
  int rank;
  int tensor;
};

std::vector<std::string> Names(const CoordinatorMessage& m) {
  std::vector<std::string> out;
  for (const Batch& b : m.batches) {
    for (const Response& r : b.responses) out.push_back(r.req.name);
  }
  return out;
}

// Checks one decision against the tensors completed since the last one
// (`fresh`, in completion order): each decided once; batches ordered by
// their first member, members in completion order.
void CheckDecision(const CoordinatorMessage& m,
                   std::vector<std::string>& fresh) {
  auto pos = [&](const std::string& name) {
    const auto it = std::find(fresh.begin(), fresh.end(), name);
    CHECK_MSG(it != fresh.end(),
              name + " decided before every rank reported it, or twice");
    return it - fresh.begin();
  };
  size_t total = 0;
  long last_head = -1;
  for (const Batch& b : m.batches) {
    long prev = -1;
    for (const Response& r : b.responses) {
      const long p = pos(r.req.name);
      CHECK_MSG(p > prev,
                "batch members out of completion order: " + r.req.name);
      prev = p;
    }
    const long head = pos(b.responses[0].req.name);
    CHECK_MSG(head > last_head,
              "batches out of order at " + b.responses[0].req.name);
    last_head = head;
    total += b.responses.size();
  }
  CHECK_MSG(total == fresh.size(), std::to_string(fresh.size() - total) +
                                       " ready tensors not decided");
  fresh.clear();
}

// Any interleaving of the ranks' reports: a tensor is decided once, only
// after every rank reported it, in the order the last reports came; the
// decision depends on that order alone.
KD_TEST(NegotiationOrderAndTiming) {
  const std::vector<Request> step = Step();
  const int64_t threshold = 256;
  for (int n = 1; n <= 4; ++n) {
    for (unsigned seed = 0; seed < 40; ++seed) {
      std::mt19937 rng(seed * 7 + n);
      std::vector<Event> events;
      for (int r = 0; r < n; ++r) {
        for (int t = 0; t < static_cast<int>(step.size()); ++t)
          events.push_back({r, t});
      }
      std::shuffle(events.begin(), events.end(), rng);
      ResponseCache cache(0);
      Coordinator coord(n, TestConfig(threshold));
      std::vector<int> reported(step.size(), 0);
      std::vector<std::string> completed, fresh;
      for (const Event& e : events) {
        coord.Add(e.rank, One(step[e.tensor]), cache);
        if (++reported[e.tensor] == n) {
          completed.push_back(step[e.tensor].name);
          fresh.push_back(step[e.tensor].name);
        }
        if (rng() % 3 == 0)
          CheckDecision(coord.Decide(cache), fresh);  // at random moments
      }
      CheckDecision(coord.Decide(cache), fresh);
      CHECK(!coord.HasPending() && !coord.HasReady());

      // The same completion order reached another way (ranks in order,
      // one tensor at a time), decided at once, gives the same message as
      // the shuffled reports decided at once.
      Coordinator a(n, TestConfig(threshold)), b(n, TestConfig(threshold));
      for (const Event& e : events) a.Add(e.rank, One(step[e.tensor]), cache);
      for (const std::string& name : completed) {
        const auto it =
            std::find_if(step.begin(), step.end(),
                         [&](const Request& q) { return q.name == name; });
        for (int r = 0; r < n; ++r) b.Add(r, One(*it), cache);
      }
      const CoordinatorMessage ma = a.Decide(cache), mb = b.Decide(cache);
      CHECK(Serialize(ma) == Serialize(mb));
      // Fusion within one decision: same dtype, under the threshold.
      for (const Batch& batch : ma.batches) {
        int64_t bytes = 0;
        for (const Response& r : batch.responses) {
          CHECK(r.req.dtype == batch.responses[0].req.dtype);
          bytes += NumElements(r.req.shape) * DataTypeSize(r.req.dtype);
        }
        CHECK_MSG(batch.responses.size() == 1 || bytes <= threshold,
                  "a fused batch of " + std::to_string(bytes) + " bytes");
      }
    }
  }
}

// One decision's error text for `name`, reported by every rank as given.
std::string DecideError(const std::vector<Request>& per_rank) {
  ResponseCache cache(0);
  Coordinator coord(static_cast<int>(per_rank.size()), TestConfig(1 << 20));
  for (int r = 0; r < static_cast<int>(per_rank.size()); ++r)
    coord.Add(r, One(per_rank[r]), cache);
  CoordinatorMessage m = coord.Decide(cache);
  CHECK(m.batches.size() == 1 && m.batches[0].responses.size() == 1);
  return m.batches[0].responses[0].error;
}

KD_TEST(MismatchNamesTensorValuesAndRanks) {
  for (int n = 2; n <= 4; ++n) {
    std::vector<Request> rs(n, Req("grad/w", {4, 2}));
    rs[n - 1].dtype = DataType::kFloat16;
    std::string e = DecideError(rs);
    CHECK_CONTAINS(e, "Mismatched dtype for allreduce 'grad/w'");
    CHECK_CONTAINS(e, "float32");
    CHECK_CONTAINS(e, "rank " + std::to_string(n - 1) + " sent float16");
    if (n == 3)
      CHECK_CONTAINS(e, "ranks 0 and 1 sent float32, rank 2 sent float16");

    rs.assign(n, Req("grad/w", {4, 2}));
    rs[0].shape = {4, 3};
    e = DecideError(rs);
    CHECK_CONTAINS(
        e, "Mismatched shape for allreduce 'grad/w': rank 0 sent shape [4, 3]");
    CHECK_CONTAINS(e, "sent shape [4, 2]");

    rs.assign(n, Req("loss", {1}));
    rs[1].reduce_op = ReduceOp::kMax;
    e = DecideError(rs);
    CHECK_CONTAINS(e, "Mismatched reduction op for allreduce 'loss'");
    CHECK_CONTAINS(e, "rank 1 sent Max");
  }
  // A different collective under the same name.
  std::vector<Request> rs = {
      Req("x", {2}), Req("x", {2}, DataType::kFloat32, OpType::kBroadcast)};
  CHECK_CONTAINS(DecideError(rs),
                 "Mismatched operation for 'x': rank 0 sent allreduce, rank 1 "
                 "sent broadcast");
  // Allgather: first dimensions may differ, the rest may not.
  rs = {Req("g", {3, 2}, DataType::kFloat32, OpType::kAllgather),
        Req("g", {1, 5}, DataType::kFloat32, OpType::kAllgather)};
  CHECK_CONTAINS(DecideError(rs), "all dimensions but the first must agree");
}

// Executes `m` as a rank does: the full responses enter its cache in order.
std::vector<Response> Execute(const CoordinatorMessage& m, ResponseCache& cache,
                              std::vector<size_t>* batch_sizes) {
  std::vector<Response> out;
  for (const Batch& b : m.batches) {
    batch_sizes->push_back(b.cache_index.size());
    for (size_t i = 0; i < b.cache_index.size(); ++i) {
      out.push_back(b.cache_index[i] >= 0 ? cache.Get(b.cache_index[i])
                                          : b.responses[i]);
    }
    for (size_t i = 0; i < b.cache_index.size(); ++i) {
      if (b.cache_index[i] < 0) cache.Put(b.responses[i]);
    }
  }
  return out;
}

// Every rank's request of one step; allgather and alltoall differ by rank.
std::vector<Request> RankStep(int rank, int n) {
  std::vector<Request> qs = Step();
  qs.push_back(
      Req("gather", {rank + 1, 3}, DataType::kFloat32, OpType::kAllgather));
  Request a2a = Req("a2a", {0, 2}, DataType::kInt64, OpType::kAlltoall);
  for (int s = 0; s < n; ++s) a2a.splits.push_back((rank + s) % 2);
  for (int64_t s : a2a.splits) a2a.shape[0] += s;
  qs.push_back(a2a);
  return qs;
}

bool SameResponse(const Response& a, const Response& b) {
  return a.req == b.req && a.error == b.error && a.first_dims == b.first_dims &&
         a.splits_matrix == b.splits_matrix;
}

// The steady state (every rank names cache entries), a mixed report (one
// rank sends its full request) and the cache switched off all give the
// decisions the first, full negotiation gave.
KD_TEST(ResponseCacheGivesTheFullPathsDecisions) {
  for (int n = 1; n <= 4; ++n) {
    std::vector<ResponseCache> caches(n, ResponseCache(100));
    Coordinator coord(n, TestConfig(256));
    auto round = [&](int full_rank, bool cache_on) {
      coord.set_cache_enabled(cache_on);
      for (int r = 0; r < n; ++r) {
        RankMessage m;
        for (const Request& q : RankStep(r, n)) {
          const int ci = r == full_rank ? -1 : caches[r].Lookup(q, r, n);
          if (ci >= 0) {
            m.cached.push_back(ci);
          } else {
            m.requests.push_back(q);
          }
        }
        coord.Add(r, m, caches[0]);
      }
      const CoordinatorMessage msg = coord.Decide(caches[0]);
      // Every rank executes the same message with its own cache.
      std::vector<size_t> sizes0;
      std::vector<Response> got0 = Execute(msg, caches[0], &sizes0);
      for (int r = 1; r < n; ++r) {
        std::vector<size_t> sizes;
        std::vector<Response> got = Execute(msg, caches[r], &sizes);
        CHECK(sizes == sizes0 && got.size() == got0.size());
        for (size_t i = 0; i < got.size(); ++i)
          CHECK(SameResponse(got[i], got0[i]));
      }
      return std::make_pair(got0, sizes0);
    };
    const auto full = round(-1, true);
    CHECK(caches[0].Count() == static_cast<int>(RankStep(0, n).size()));
    for (const Response& r : full.first) CHECK_MSG(r.error.empty(), r.error);
    for (int full_rank : {-2, 0, n - 1}) {
      for (bool on : {true, false}) {
        const auto again = round(full_rank, on);
        CHECK_MSG(again.second == full.second, "the fusion plan changed");
        for (size_t i = 0; i < full.first.size(); ++i) {
          CHECK_MSG(SameResponse(again.first[i], full.first[i]),
                    "decision for " + full.first[i].req.name + " changed");
        }
      }
    }
    // The steady state sends no request at all.
    RankMessage m;
    for (const Request& q : RankStep(0, n))
      m.cached.push_back(caches[0].Lookup(q, 0, n));
    for (int32_t ci : m.cached) CHECK(ci >= 0);
  }
}

KD_TEST(StallReportNamesTheMissingRanks) {
  Config c = TestConfig(1 << 20);
  c.stall_check_time_s = 60;
  c.stall_shutdown_time_s = 120;
  for (int n = 2; n <= 4; ++n) {
    ResponseCache cache(0);
    Coordinator coord(n, c);
    const Clock::time_point start = Clock::now();
    // Every rank but 1 submits "late"; every rank submits "fine".
    for (int r = 0; r < n; ++r) {
      if (r != 1) coord.Add(r, One(Req("late", {2})), cache);
      coord.Add(r, One(Req("fine", {2})), cache);
    }
    CHECK(Names(coord.Decide(cache)) == std::vector<std::string>{"fine"});
    CHECK(coord.CheckStalls(start).warnings.empty());
    StallReport rep = coord.CheckStalls(start + std::chrono::seconds(61));
    CHECK(rep.warnings.size() == 1 && rep.shutdown_reason.empty());
    std::string ready = "0";
    for (int r = 2; r < n; ++r) ready += ", " + std::to_string(r);
    CHECK_CONTAINS(rep.warnings[0], "allreduce 'late' has waited 6");
    CHECK_CONTAINS(rep.warnings[0], "submitted by rank(s) " + ready +
                                        ", still missing on rank(s) 1.");
    // Warned once; past the shutdown limit the job fails, naming rank 1.
    CHECK(coord.CheckStalls(start + std::chrono::seconds(90)).warnings.empty());
    rep = coord.CheckStalls(start + std::chrono::seconds(121));
    CHECK_CONTAINS(rep.shutdown_reason,
                   "KERASDIST_STALL_SHUTDOWN_TIME_SECONDS");
    CHECK_CONTAINS(rep.shutdown_reason, "still missing on rank(s) 1.");
    // Rank 1 catches up: decided, and no longer stalled.
    coord.Add(1, One(Req("late", {2})), cache);
    CHECK(Names(coord.Decide(cache)) == std::vector<std::string>{"late"});
    CHECK(coord.CheckStalls(start + std::chrono::seconds(200))
              .shutdown_reason.empty());
  }
}

// A group runs when all of its members are ready on every rank, in name order.
KD_TEST(GroupedTensorsWaitForTheWholeGroup) {
  for (int n = 1; n <= 4; ++n) {
    ResponseCache cache(0);
    Coordinator coord(n, TestConfig(1 << 20));
    auto member = [](const std::string& name) {
      Request q = Req(name, {4});
      q.group = "g";
      q.group_size = 2;
      return q;
    };
    for (int r = 0; r < n; ++r) coord.Add(r, One(member("g/z")), cache);
    CHECK(Names(coord.Decide(cache)).empty());
    for (int r = n - 1; r >= 0; --r) coord.Add(r, One(member("g/a")), cache);
    CHECK(
        (Names(coord.Decide(cache)) == std::vector<std::string>{"g/a", "g/z"}));
  }
}

KD_TEST(ShutdownNamesTheRank) {
  ResponseCache cache(0);
  Coordinator coord(3, TestConfig(1 << 20));
  RankMessage m;
  m.shutdown = true;
  coord.Add(2, m, cache);
  CHECK(coord.HasReady());
  CoordinatorMessage out = coord.Decide(cache);
  CHECK(out.shutdown);
  CHECK_CONTAINS(out.shutdown_reason, "rank 2 shut down");
}

// The middle of JoinedRanksServeAllreducesUntilEveryRankJoined (rank 1 of
// 3 has joined): other collectives fail, and a real deadlock is named.
static void JoinedRankRefusesOthersAndDeadlocks(Coordinator& coord,
                                                ResponseCache& cache) {
  CoordinatorMessage m;
  // Broadcast and allgather fail clearly instead of waiting for rank 1.
  for (OpType op : {OpType::kBroadcast, OpType::kAllgather}) {
    for (int r : {0, 2})
      coord.Add(r, One(Req("x", {2}, DataType::kFloat32, op)), cache);
    m = coord.Decide(cache);
    CHECK((Names(m) == std::vector<std::string>{"x"}));
    CHECK_CONTAINS(m.batches[0].responses[0].error,
                   "cannot run while rank(s) 1 have called join()");
    cache.Put(m.batches[0].responses[0]);  // never cached
    CHECK(cache.IndexOf("x") < 0);
  }
  // Rank 0 waits on "p", rank 2 on "q", rank 1 in join: a deadlock, named.
  coord.Add(0, One(Req("p", {1})), cache);
  coord.Add(2, One(Req("q", {1})), cache);
  const Clock::time_point t = Clock::now();
  CHECK(coord.CheckStalls(t).shutdown_reason.empty());
  StallReport rep = coord.CheckStalls(t + std::chrono::seconds(6));
  CHECK(rep.deadlock);
  CHECK_CONTAINS(rep.shutdown_reason, "rank 1 waits on 1 (join())");
  coord.Add(2, One(Req("p", {1})), cache);
  coord.Add(0, One(Req("q", {1})), cache);
  CHECK((Names(coord.Decide(cache)) == std::vector<std::string>{"p", "q"}));
}

// join(): a joined rank counts as having reported every allreduce (from
// the cache too) until every rank has joined; other collectives become
// errors; the join itself returns the last rank to join, and then ranks
// count again.
KD_TEST(JoinedRanksServeAllreducesUntilEveryRankJoined) {
  const int n = 3;
  ResponseCache cache(100);
  Config c = TestConfig(1 << 20);
  c.deadlock_shutdown_time_s = 5;
  Coordinator coord(n, c);
  Request join = Req("kerasdist.join", {}, DataType::kInt32, OpType::kJoin);
  // "pre" is pending on rank 0 when rank 1 joins: ready at the join.
  coord.Add(0, One(Req("pre", {4})), cache);
  coord.Add(2, One(Req("pre", {4})), cache);
  CHECK(Names(coord.Decide(cache)).empty());
  coord.Add(1, One(join), cache);
  CoordinatorMessage m = coord.Decide(cache);
  CHECK((Names(m) == std::vector<std::string>{"pre"}));
  CHECK(m.batches[0].responses[0].error.empty());
  CHECK(m.batches[0].responses[0].req.shape == std::vector<int64_t>{4});
  cache.Put(m.batches[0].responses[0]);
  // A new allreduce needs ranks 0 and 2 only, as full requests and as
  // cache hits (then the batch names the cache entry).
  for (int r : {2, 0})
    coord.Add(r, One(Req("a", {3}, DataType::kInt64)), cache);
  m = coord.Decide(cache);
  CHECK((Names(m) == std::vector<std::string>{"a"}));
  CHECK(m.batches[0].responses[0].req.dtype == DataType::kInt64);
  for (int r : {0, 2}) {
    RankMessage hit;
    hit.cached.push_back(cache.Lookup(Req("pre", {4}), r, n));
    CHECK(hit.cached[0] >= 0);
    coord.Add(r, hit, cache);
  }
  m = coord.Decide(cache);
  CHECK(m.batches.size() == 1 && m.batches[0].cache_index.size() == 1 &&
        m.batches[0].cache_index[0] >= 0);
  JoinedRankRefusesOthersAndDeadlocks(coord, cache);
  // Rank 2 then rank 0 join: every join returns 0; no tensor is cached.
  coord.Add(2, One(join), cache);
  CHECK(Names(coord.Decide(cache)).empty());
  coord.Add(0, One(join), cache);
  m = coord.Decide(cache);
  CHECK((Names(m) == std::vector<std::string>{"kerasdist.join"}));
  const Response& done = m.batches[0].responses[0];
  CHECK(done.req.op == OpType::kJoin && done.req.root_rank == 0);
  cache.Put(done);
  CHECK(cache.IndexOf("kerasdist.join") < 0);
  // Joins are over: a tensor needs every rank again.
  coord.Add(0, One(Req("b", {2})), cache);
  coord.Add(2, One(Req("b", {2})), cache);
  CHECK(Names(coord.Decide(cache)).empty());
  coord.Add(1, One(Req("b", {2})), cache);
  CHECK((Names(coord.Decide(cache)) == std::vector<std::string>{"b"}));
}

}  // namespace
}  // namespace kdtest
