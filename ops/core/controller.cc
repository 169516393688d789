#include "controller.h"

#include <algorithm>

#include "fusion.h"

namespace kerasdist::core {

int ResponseCache::Lookup(const Request& local, int rank, int size) const {
  auto it = index_.find(local.name);
  if (it == index_.end()) return -1;
  return RequestForRank(entries_[it->second], rank, size) == local ? it->second
                                                                    : -1;
}

int ResponseCache::IndexOf(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

void ResponseCache::Put(const Response& r) {
  if (!r.error.empty()) return;
  auto it = index_.find(r.req.name);
  if (it != index_.end()) {
    entries_[it->second] = r;
  } else if (static_cast<int64_t>(entries_.size()) < capacity_) {
    index_[r.req.name] = static_cast<int>(entries_.size());
    entries_.push_back(r);
  }
}

void Coordinator::Add(int rank, const RankMessage& m, const ResponseCache& cache) {
  for (int32_t idx : m.cached) {
    if (idx >= 0 && idx < cache.Count()) {
      MarkReported(rank, RequestForRank(cache.Get(idx), rank, size_));
    }
  }
  for (const Request& q : m.requests) MarkReported(rank, q);
  if (m.shutdown) RequestShutdown(rank);
}

void Coordinator::MarkReported(int rank, Request q) {
  auto it = table_.find(q.name);
  if (it == table_.end()) {
    Pending p;
    p.per_rank.resize(size_);
    p.have.assign(size_, false);
    p.first_seen = Clock::now();
    if (record_) p.seen.resize(size_);
    it = table_.emplace(q.name, std::move(p)).first;
  }
  Pending& p = it->second;
  if (p.have[rank]) return;
  p.have[rank] = true;
  p.per_rank[rank] = std::move(q);
  if (record_ && !p.seen.empty()) p.seen[rank] = Clock::now();
  if (++p.count < size_) return;
  std::string name = it->first;
  if (record_ && !p.seen.empty()) {
    ReadyInfo info;
    info.name = name;
    for (int r = 0; r < size_; ++r) {
      if (p.seen[r] < p.seen[info.first_rank]) info.first_rank = r;
      if (p.seen[r] > p.seen[info.last_rank]) info.last_rank = r;
    }
    info.first = p.seen[info.first_rank];
    info.last = p.seen[info.last_rank];
    for (int r = 0; r < size_; ++r) {
      info.wait_us.push_back(std::chrono::duration_cast<std::chrono::microseconds>(
                                 p.seen[r] - info.first).count());
    }
    ready_info_.push_back(std::move(info));
  }
  const Request& head = p.per_rank[0];
  if (head.group.empty() || head.group_size <= 1) {
    ready_.push_back(name);
    return;
  }
  // A group runs only when all of its members are ready on every rank.
  std::string group = head.group;
  int group_size = head.group_size;
  held_[name] = std::move(p.per_rank);
  table_.erase(it);
  auto& members = group_ready_[group];
  members.push_back(name);
  if (static_cast<int>(members.size()) >= group_size) {
    std::sort(members.begin(), members.end());
    for (const auto& n : members) ready_.push_back(n);
    group_ready_.erase(group);
  }
}

CoordinatorMessage Coordinator::Decide(const ResponseCache& cache) {
  CoordinatorMessage out;
  std::vector<Response> responses;
  std::vector<int32_t> indices;
  for (const std::string& name : ready_) {
    std::vector<Request> per_rank;
    auto h = held_.find(name);
    if (h != held_.end()) {
      per_rank = std::move(h->second);
      held_.erase(h);
    } else {
      auto it = table_.find(name);
      per_rank = std::move(it->second.per_rank);
      table_.erase(it);
    }
    int ci = cache_enabled_ ? cache.IndexOf(name) : -1;
    for (int r = 0; ci >= 0 && r < size_; ++r) {
      if (RequestForRank(cache.Get(ci), r, size_) != per_rank[r]) ci = -1;
    }
    responses.push_back(ci >= 0 ? cache.Get(ci) : BuildResponse(per_rank));
    indices.push_back(ci);
  }
  ready_.clear();
  for (const auto& batch : PlanFusion(responses, config_.fusion_threshold_bytes)) {
    Batch b;
    for (int i : batch) {
      b.cache_index.push_back(indices[i]);
      b.responses.push_back(indices[i] >= 0 ? Response() : responses[i]);
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
      std::string& s = p.have[r] ? ready : missing;
      s += (s.empty() ? "" : ", ") + std::to_string(r);
    }
    const Request* any = nullptr;
    for (int r = 0; r < size_ && !any; ++r) {
      if (p.have[r]) any = &p.per_rank[r];
    }
    std::string line = std::string(OpTypeName(any->op)) + " '" + name +
                       "' has waited " + std::to_string(static_cast<int>(waited)) +
                       " s: submitted by rank(s) " + ready +
                       ", still missing on rank(s) " + missing + ".";
    if (warn) {
      p.warned = true;
      report.warnings.push_back(
          "kerasdist: stall: " + line +
          " One or more ranks skipped this collective or are stuck before it "
          "(all ranks must run the same collectives).");
    }
    if (fail && report.shutdown_reason.empty()) {
      report.shutdown_reason =
          "stalled for more than KERASDIST_STALL_SHUTDOWN_TIME_SECONDS: " + line;
    }
  }
  return report;
}

}  // namespace kerasdist::core
