#include "controller.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "fusion.h"

namespace kerasdist::core {

int ResponseCache::Lookup(const Request& local, int rank, int size) const {
  auto it = index_.find(local.name);
  if (it == index_.end()) return -1;
  return MatchesForRank(entries_[it->second], rank, size, local) ? it->second
                                                                 : -1;
}

int ResponseCache::IndexOf(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

void ResponseCache::Put(const Response& r) {
  if (!r.error.empty() || r.req.op == OpType::kJoin) return;
  auto it = index_.find(r.req.name);
  if (it != index_.end()) {
    entries_[it->second] = r;
  } else if (static_cast<int64_t>(entries_.size()) < capacity_) {
    index_[r.req.name] = static_cast<int>(entries_.size());
    entries_.push_back(r);
  }
}

void Coordinator::Add(int rank, const RankMessage& m,
                      const ResponseCache& cache) {
  for (int32_t idx : m.cached) {
    if (idx >= 0 && idx < cache.Count()) {
      MarkReported(rank, cache.Get(idx).req.name, nullptr, idx, cache);
    }
  }
  for (const Request& q : m.requests) MarkReported(rank, q.name, &q, -1, cache);
  if (m.shutdown) RequestShutdown(rank);
}

void Coordinator::MarkReported(int rank, const std::string& name,
                               const Request* q, int32_t cached,
                               const ResponseCache& cache) {
  if (q != nullptr && q->op == OpType::kJoin) {
    Join(rank, *q, cache);
    return;
  }
  auto it = FindOrStart(name, q, cached, cache);
  Pending& p = it->second;
  if (p.have[rank]) return;
  p.have[rank] = true;
  ++reports_;
  if (q != nullptr) {
    p.per_rank[rank] = *q;
  } else {
    p.cached[rank] = cached;
  }
  if (record_ && !p.seen.empty()) p.seen[rank] = Clock::now();
  ++p.count;
  if (AllReported(p)) Finish(it, cache);
}

bool Coordinator::AllReported(const Pending& p) const {
  if (p.count >= size_) return true;
  if (joined_count_ == 0) return false;
  for (int r = 0; r < size_; ++r) {
    if (!p.have[r] && !joined_[r]) return false;
  }
  return true;
}

void Coordinator::Finish(Table::iterator it, const ResponseCache& cache) {
  Pending& p = it->second;
  if (record_ && !p.seen.empty()) {
    for (int r = 0; r < size_; ++r) {
      if (!p.have[r]) p.seen[r] = p.first_seen;  // joined: zeros at once
    }
    RecordReadyInfo(it->first, p);
  }
  Ready ready = MakeReady(it->first, p, cache);
  spare_.push_back(table_.extract(it));
  Release(std::move(ready), cache);
}

void Coordinator::Join(int rank, const Request& q, const ResponseCache& cache) {
  if (joined_.empty()) joined_.assign(size_, false);
  if (joined_[rank]) return;
  joined_[rank] = true;
  ++joined_count_;
  last_joined_ = rank;
  ++reports_;
  // What every other rank had reported can run now, with zeros from here.
  for (auto it = table_.begin(); it != table_.end();) {
    auto next = std::next(it);
    if (AllReported(it->second)) Finish(it, cache);
    it = next;
  }
  if (joined_count_ < size_) return;
  // Every rank has joined: every join returns the last rank to join.
  Ready ready;
  ready.name = q.name;
  ready.join = true;
  ready.per_rank.assign(1, q);
  ready.per_rank[0].root_rank = last_joined_;
  ready_.push_back(std::move(ready));
  joined_.assign(size_, false);
  joined_count_ = 0;
  last_joined_ = -1;
}

Coordinator::Table::iterator Coordinator::FindOrStart(
    const std::string& name, const Request* q, int32_t cached,
    const ResponseCache& cache) {
  auto it = table_.find(name);
  if (it != table_.end()) return it;
  Table::node_type node;
  if (!spare_.empty()) {
    node = std::move(spare_.back());
    spare_.pop_back();
    node.key() = name;
  } else {
    Table fresh;
    node = fresh.extract(fresh.emplace(name, Pending()).first);
  }
  Pending& p = node.mapped();
  p.per_rank.resize(size_);
  p.cached.assign(size_, -1);
  p.have.assign(size_, false);
  p.count = 0;
  p.warned = false;
  p.first_seen = Clock::now();
  p.op = q != nullptr ? q->op : cache.Get(cached).req.op;
  if (record_) {
    p.seen.resize(size_);
  } else {
    p.seen.clear();
  }
  return table_.insert(std::move(node)).position;
}

void Coordinator::RecordReadyInfo(const std::string& name, const Pending& p) {
  ReadyInfo info;
  info.name = name;
  for (int r = 0; r < size_; ++r) {
    if (p.seen[r] < p.seen[info.first_rank]) info.first_rank = r;
    if (p.seen[r] > p.seen[info.last_rank]) info.last_rank = r;
  }
  info.first = p.seen[info.first_rank];
  info.last = p.seen[info.last_rank];
  for (int r = 0; r < size_; ++r) {
    info.wait_us.push_back(
        std::chrono::duration_cast<std::chrono::microseconds>(p.seen[r] -
                                                              info.first)
            .count());
  }
  ready_info_.push_back(std::move(info));
}

Coordinator::Ready Coordinator::MakeReady(const std::string& name, Pending& p,
                                          const ResponseCache& cache) {
  Ready ready;
  ready.name = name;
  // Ranks that joined without reporting it stand in as copies of the first
  // reporting rank (allreduce has the same request on every rank).
  int first = 0;
  while (!p.have[first]) ++first;
  std::string absent;
  for (int r = 0; r < size_; ++r) {
    if (!p.have[r]) absent += (absent.empty() ? "" : ", ") + std::to_string(r);
  }
  bool same_entry = p.cached[first] >= 0;
  for (int r = 0; r < size_ && same_entry; ++r)
    same_entry = !p.have[r] || p.cached[r] == p.cached[first];
  if (!absent.empty()) {
    const Request& q = p.cached[first] >= 0 ? cache.Get(p.cached[first]).req
                                            : p.per_rank[first];
    if (q.op != OpType::kAllreduce) {
      ready.error = std::string(OpTypeName(q.op)) + " '" + name +
                    "' cannot run while rank(s) " + absent +
                    " have called join(): a joined rank takes part in "
                    "allreduces only (with zeros), as in Horovod. Run " +
                    OpTypeName(q.op) +
                    " before join() on every rank, or after every rank's "
                    "join() has returned";
      same_entry = false;
    } else if (q.device >= 0) {
      ready.error = "allreduce '" + name + "' cannot run while rank(s) " +
                    absent +
                    " have called join(): join() serves allreduces of "
                    "host tensors only in this build (this one is in GPU "
                    "memory)";
      same_entry = false;
    }
  }
  if (same_entry) {
    ready.cache_index = p.cached[first];
    return ready;
  }
  // Mixed or full reports: every rank's request, spelled out.
  ready.per_rank.resize(size_);
  for (int r = 0; r < size_; ++r) {
    if (!p.have[r]) continue;
    ready.per_rank[r] = p.cached[r] >= 0
                            ? RequestForRank(cache.Get(p.cached[r]), r, size_)
                            : std::move(p.per_rank[r]);
  }
  for (int r = 0; r < size_; ++r) {
    if (!p.have[r]) ready.per_rank[r] = ready.per_rank[first];
  }
  return ready;
}

void Coordinator::Release(Ready ready, const ResponseCache& cache) {
  const Request& head = ready.cache_index >= 0
                            ? cache.Get(ready.cache_index).req
                            : ready.per_rank[0];
  if (head.group.empty() || head.group_size <= 1) {
    ready_.push_back(std::move(ready));
    return;
  }
  // A group runs only when all of its members are ready on every rank.
  const int group_size = head.group_size;
  auto g = group_ready_.find(head.group);
  if (g == group_ready_.end())
    g = group_ready_.emplace(head.group, std::vector<Ready>()).first;
  std::vector<Ready>& members = g->second;
  members.push_back(std::move(ready));
  if (static_cast<int>(members.size()) >= group_size) {
    std::sort(members.begin(), members.end(),
              [](const Ready& a, const Ready& b) { return a.name < b.name; });
    for (Ready& m : members) ready_.push_back(std::move(m));
    group_ready_.erase(g);
  }
}

void Coordinator::Choose(Ready& item, const ResponseCache& cache,
                         std::vector<Response>* built,
                         std::vector<const Response*>* chosen,
                         std::vector<int32_t>* indices) {
  if (item.join || !item.error.empty()) {
    Response r;
    r.req = std::move(item.per_rank[0]);
    r.error = std::move(item.error);
    built->push_back(std::move(r));
    chosen->push_back(&built->back());
    indices->push_back(-1);
    return;
  }
  if (item.cache_index >= 0 && cache_enabled_) {
    // Every rank asked exactly what the cache entry says.
    chosen->push_back(&cache.Get(item.cache_index));
    indices->push_back(item.cache_index);
    return;
  }
  if (item.cache_index >= 0) {
    const Response& entry = cache.Get(item.cache_index);
    item.per_rank.resize(size_);
    for (int r = 0; r < size_; ++r)
      item.per_rank[r] = RequestForRank(entry, r, size_);
  }
  int ci = cache_enabled_ ? cache.IndexOf(item.name) : -1;
  for (int r = 0; ci >= 0 && r < size_; ++r) {
    if (!MatchesForRank(cache.Get(ci), r, size_, item.per_rank[r])) ci = -1;
  }
  if (ci >= 0) {
    chosen->push_back(&cache.Get(ci));
  } else {
    built->push_back(BuildResponse(item.per_rank));
    chosen->push_back(&built->back());
  }
  indices->push_back(ci);
}

CoordinatorMessage Coordinator::Decide(const ResponseCache& cache) {
  CoordinatorMessage out;
  // Built responses live here; `chosen` points at them or at cache entries.
  std::vector<Response> built;
  built.reserve(ready_.size());
  std::vector<const Response*> chosen;
  std::vector<int32_t> indices;
  chosen.reserve(ready_.size());
  indices.reserve(ready_.size());
  for (Ready& item : ready_) Choose(item, cache, &built, &chosen, &indices);
  ready_.clear();
  for (const auto& batch : PlanFusion(chosen, config_.fusion_threshold_bytes)) {
    Batch b;
    b.cache_index.reserve(batch.size());
    b.responses.resize(batch.size());
    for (size_t k = 0; k < batch.size(); ++k) {
      const int i = batch[k];
      b.cache_index.push_back(indices[i]);
      if (indices[i] < 0) b.responses[k] = *chosen[i];
    }
    out.batches.push_back(std::move(b));
  }
  if (shutdown_rank_ >= 0) {
    out.shutdown = true;
    out.shutdown_reason =
        "rank " + std::to_string(shutdown_rank_) +
        " shut down (it called kerasdist.shutdown() or its process exited)";
  }
  return out;
}

StallReport Coordinator::CheckStalls(Clock::time_point now) {
  StallReport report;
  for (auto& [name, p] : table_) {
    double waited = std::chrono::duration<double>(now - p.first_seen).count();
    bool warn = config_.stall_check_time_s > 0 &&
                waited >= config_.stall_check_time_s && !p.warned;
    bool fail = config_.stall_shutdown_time_s > 0 &&
                waited >= config_.stall_shutdown_time_s;
    if (!warn && !fail) continue;
    std::string ready, missing;
    for (int r = 0; r < size_; ++r) {
      const bool joined = joined_count_ > 0 && joined_[r];
      std::string& s = p.have[r] || joined ? ready : missing;
      s += (s.empty() ? "" : ", ") + std::to_string(r) +
           (joined && !p.have[r] ? " (joined)" : "");
    }
    std::string line =
        std::string(OpTypeName(p.op)) + " '" + name + "' has waited " +
        std::to_string(static_cast<int>(waited)) + " s: submitted by rank(s) " +
        ready + ", still missing on rank(s) " + missing + ".";
    if (warn) {
      p.warned = true;
      report.warnings.push_back(
          "kerasdist: stall: " + line +
          " One or more ranks skipped this collective or are stuck before it "
          "(all ranks must run the same collectives; where the ranks' data "
          "differ in length, use kd.data.shard and "
          "kd.callbacks.EqualizeStepsCallback).");
    }
    if (fail && report.shutdown_reason.empty()) {
      report.shutdown_reason =
          "stalled for more than KERASDIST_STALL_SHUTDOWN_TIME_SECONDS: " +
          line;
    }
  }
  if (report.shutdown_reason.empty()) {
    report.shutdown_reason = DeadlockReason(now);
    report.deadlock = !report.shutdown_reason.empty();
  }
  return report;
}

namespace {

// kerasdist's collectives at the end of an epoch (MetricAverageCallback's
// "kerasdist.metric_average.epoch", EqualizeStepsCallback's count, ...).
bool AtEpochEnd(const std::string& op_and_name) {
  std::string name = op_and_name;
  for (char& c : name) c = static_cast<char>(std::tolower(c));
  return name.find("epoch") != std::string::npos ||
         name.find("min_steps") != std::string::npos;
}

// 60 -> "60", 2.5 -> "2.5".
std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

}  // namespace

std::string Coordinator::DeadlockReason(Clock::time_point now) {
  if (reports_ != reports_at_check_) {
    reports_at_check_ = reports_;
    unchanged_since_ = now;
    return "";
  }
  const double bound = config_.deadlock_shutdown_time_s;
  if (bound <= 0 || table_.empty() || !ready_.empty() ||
      !group_ready_.empty() || shutdown_rank_ >= 0 ||
      now - unchanged_since_ < std::chrono::duration<double>(bound)) {
    return "";
  }
  // Each rank's pending collectives; a rank with none may still submit the
  // missing ones (it is computing, or slow): no deadlock yet.
  std::vector<std::vector<std::string>> waits(size_);
  for (const auto& [name, p] : table_) {
    for (int r = 0; r < size_; ++r) {
      if (p.have[r])
        waits[r].push_back(std::string(OpTypeName(p.op)) + " '" + name + "'");
    }
  }
  bool some_at_epoch_end = false, some_training = false;
  std::string ranks;
  for (int r = 0; r < size_; ++r) {
    std::vector<std::string>& w = waits[r];
    // A rank in join() waits for the others to join, serving their
    // allreduces meanwhile.
    if (joined_count_ > 0 && joined_[r]) w.push_back("join()");
    if (w.empty()) return "";
    std::sort(w.begin(), w.end());
    if (std::any_of(w.begin(), w.end(), AtEpochEnd)) {
      some_at_epoch_end = true;
    } else {
      some_training = true;
    }
    std::string names;
    for (size_t i = 0; i < w.size() && i < 3; ++i)
      names += (i ? ", " : "") + w[i];
    if (w.size() > 3) names += ", ...";
    ranks += (r ? "; rank " : "rank ") + std::to_string(r) + " waits on " +
             std::to_string(w.size()) + " (" + names + ")";
  }
  const std::string cause =
      some_at_epoch_end && some_training
          ? "Likely cause: uneven data: the ranks ran different numbers of "
            "steps, so one reached the end of its epoch while another still "
            "trains. Give every rank the same number of batches: shard with "
            "kd.data.shard(...) and add "
            "kd.callbacks.EqualizeStepsCallback() to fit() (or pass "
            "steps_per_epoch=kd.data.equalize_steps(...))"
          : "Likely cause: a rank skipped a collective the others ran (for "
            "example after an exception it caught: look for it in that "
            "rank's output) or submitted them under other names; every rank "
            "must run the same collectives. If the ranks' data differ in "
            "length, shard with kd.data.shard(...) and add "
            "kd.callbacks.EqualizeStepsCallback()";
  return "deadlock: every rank is waiting for collectives no other rank has "
         "submitted, unchanged for " +
         Seconds(bound) + " s, so none can run: " + ranks + ". " + cause +
         ". Ending the job (KERASDIST_DEADLOCK_SHUTDOWN_TIME_SECONDS; 0 turns "
         "this off)";
}

}  // namespace kerasdist::core
