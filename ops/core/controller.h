// Negotiation: the response cache every rank keeps in lock-step, and the
// coordinator (rank 0) that decides which tensors are ready on every rank, in
// which order they run and how they are fused.
#ifndef KERASDIST_CORE_CONTROLLER_H_
#define KERASDIST_CORE_CONTROLLER_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "config.h"
#include "message.h"

namespace kerasdist::core {

using Clock = std::chrono::steady_clock;

// Responses that ran before, by name. Every rank inserts the full responses
// it executes in the coordinator's order, so an index means the same tensor on
// every rank; the steady state then sends indices instead of requests.
class ResponseCache {
 public:
  explicit ResponseCache(int64_t capacity) : capacity_(capacity) {}
  // Index of `local`'s entry if this rank's request equals the cached one.
  int Lookup(const Request& local, int rank, int size) const;
  int IndexOf(const std::string& name) const;
  const Response& Get(int index) const { return entries_[index]; }
  int Count() const { return static_cast<int>(entries_.size()); }
  // Overwrites the entry of the same name, else appends while there is room.
  // Errors and joins are never cached.
  void Put(const Response& r);

 private:
  int64_t capacity_;
  std::vector<Response> entries_;
  std::unordered_map<std::string, int> index_;
};

// When each rank reported a tensor that just became ready (for the timeline).
struct ReadyInfo {
  std::string name;
  Clock::time_point first, last;
  int first_rank = 0, last_rank = 0;
  std::vector<int64_t> wait_us;  // per rank: from the first report to its own
};

struct StallReport {
  std::vector<std::string> warnings;  // one line per newly stalled tensor
  std::string shutdown_reason;        // non-empty: fail the job
  bool deadlock = false;  // the reason is a certain deadlock (DeadlockReason)
};

class Coordinator {
 public:
  Coordinator(int size, const Config& config) : size_(size), config_(config) {}

  // Records what `rank` has newly pending.
  void Add(int rank, const RankMessage& m, const ResponseCache& cache);
  // What every rank executes next; empty when nothing is ready.
  CoordinatorMessage Decide(const ResponseCache& cache);
  StallReport CheckStalls(Clock::time_point now);
  bool HasReady() const { return !ready_.empty() || shutdown_rank_ >= 0; }
  bool HasPending() const { return !table_.empty(); }
  void RequestShutdown(int rank) {
    if (shutdown_rank_ < 0) shutdown_rank_ = rank;
  }
  void set_fusion_threshold(int64_t bytes) {
    config_.fusion_threshold_bytes = bytes;
  }
  void set_cache_enabled(bool on) { cache_enabled_ = on; }
  void set_record(bool on) { record_ = on; }
  std::vector<ReadyInfo> TakeReadyInfo() { return std::move(ready_info_); }

 private:
  // `rank` reported tensor `name`: as a full request `q`, or (q null) as
  // the cache entry `cached`, which stands for RequestForRank(entry, rank).
  void MarkReported(int rank, const std::string& name, const Request* q,
                    int32_t cached, const ResponseCache& cache);

  struct Pending;
  struct Ready;
  // A certain deadlock: every rank waits on at least one collective, none of
  // them has been submitted by every rank (so none can run), and no rank has
  // submitted anything for deadlock_shutdown_time_s. Then: one line naming
  // each rank's pending collectives and the likely cause; else "".
  std::string DeadlockReason(Clock::time_point now);

  // The table's entry for `name`, started (from a recycled node) if new.
  std::unordered_map<std::string, Pending>::iterator FindOrStart(
      const std::string& name, const Request* q, int32_t cached,
      const ResponseCache& cache);
  // `rank` called join(): from now on it counts as having reported every
  // allreduce (it runs them with zeros) until every rank has joined.
  void Join(int rank, const Request& q, const ResponseCache& cache);
  // Reported by every rank that has not joined.
  bool AllReported(const Pending& p) const;
  // `it`, reported by every rank that has not joined, leaves the table.
  void Finish(std::unordered_map<std::string, Pending>::iterator it,
              const ResponseCache& cache);
  // For the timeline: when each rank reported `name`.
  void RecordReadyInfo(const std::string& name, const Pending& p);
  // `p` reported by every rank, as a Ready (the cache entry when all named
  // the same one, else every rank's request).
  // Decide's choice for one ready tensor: a cache entry (its index) or a
  // response built into `built` (index -1), appended to `chosen`/`indices`.
  void Choose(Ready& item, const ResponseCache& cache,
              std::vector<Response>* built,
              std::vector<const Response*>* chosen,
              std::vector<int32_t>* indices);
  Ready MakeReady(const std::string& name, Pending& p,
                  const ResponseCache& cache);
  // Queues `ready` for the next decision, or holds it until its whole group
  // is ready on every rank.
  void Release(Ready ready, const ResponseCache& cache);

  struct Pending {
    std::vector<Request> per_rank;  // where cached[rank] < 0
    std::vector<int32_t> cached;    // per rank: the cache entry it named, or -1
    std::vector<bool> have;
    std::vector<Clock::time_point> seen;
    int count = 0;
    OpType op = OpType::kAllreduce;
    Clock::time_point first_seen;
    bool warned = false;
  };
  // A tensor every rank has reported. In the steady state every rank names
  // the same cache entry (`cache_index` >= 0, `per_rank` empty) and the
  // decision copies no request or response; otherwise `per_rank` holds every
  // rank's request.
  // Ranks that joined and did not report it get a copy of a reporting
  // rank's request. `error` non-empty: the collective fails on every rank
  // (only allreduce runs while ranks have joined). `join`: every rank has
  // joined; per_rank[0].root_rank is the last one.
  struct Ready {
    std::string name;
    int32_t cache_index = -1;
    std::vector<Request> per_rank;
    std::string error;
    bool join = false;
  };
  using Table = std::unordered_map<std::string, Pending>;

  int size_;
  Config config_;
  Table table_;
  // Entries of table_ taken out, kept with their buffers for the next tensor
  // (every step reports the same tensors again).
  std::vector<Table::node_type> spare_;
  std::vector<Ready> ready_;  // fully reported, in order
  std::unordered_map<std::string, std::vector<Ready>>
      group_ready_;  // waiting for the group
  int shutdown_rank_ = -1;
  // Ranks waiting in join(), how many, and the last one to join.
  std::vector<bool> joined_;
  int joined_count_ = 0;
  int last_joined_ = -1;
  // Reports so far, and their count when DeadlockReason last saw it change.
  uint64_t reports_ = 0, reports_at_check_ = 0;
  Clock::time_point unchanged_since_;
  bool cache_enabled_ = true;
  bool record_ = false;
  std::vector<ReadyInfo> ready_info_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_CONTROLLER_H_
