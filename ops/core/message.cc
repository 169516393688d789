#include "message.h"

#include <cstring>

namespace kerasdist::core {

bool Request::operator==(const Request& o) const {
  return name == o.name && op == o.op && reduce_op == o.reduce_op &&
         dtype == o.dtype && shape == o.shape && root_rank == o.root_rank &&
         prescale == o.prescale && postscale == o.postscale &&
         splits == o.splits && group == o.group && group_size == o.group_size &&
         device == o.device;
}

Request RequestForRank(const Response& r, int rank, int size) {
  Request q = r.req;
  if (q.op == OpType::kAllgather && !q.shape.empty()) {
    q.shape[0] = r.first_dims[rank];
  } else if (q.op == OpType::kAlltoall) {
    q.splits.assign(r.splits_matrix.begin() + rank * size,
                    r.splits_matrix.begin() + (rank + 1) * size);
    int64_t rows = 0;
    for (int64_t s : q.splits) rows += s;
    if (!q.shape.empty()) q.shape[0] = rows;
  }
  return q;
}

bool MatchesForRank(const Response& r, int rank, int size, const Request& q) {
  if (r.req.op == OpType::kAllgather || r.req.op == OpType::kAlltoall) {
    return RequestForRank(r, rank, size) == q;
  }
  return r.req == q;
}

namespace {

std::string RankList(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += (i + 1 == ranks.size()) ? " and " : ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// Groups ranks by the value `key` gives and describes the disagreement, e.g.
// "rank 0 sent float32, rank 1 sent float16".
template <typename F>
std::string Disagreement(const std::vector<Request>& rs, F key) {
  std::vector<std::string> values;
  std::vector<std::vector<int>> ranks;
  for (size_t r = 0; r < rs.size(); ++r) {
    std::string v = key(rs[r]);
    size_t i = 0;
    while (i < values.size() && values[i] != v) ++i;
    if (i == values.size()) {
      values.push_back(v);
      ranks.emplace_back();
    }
    ranks[i].push_back(static_cast<int>(r));
  }
  std::string s;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) s += ", ";
    s += (ranks[i].size() == 1 ? "rank " : "ranks ") + RankList(ranks[i]) +
         " sent " + values[i];
  }
  return s;
}

template <typename F>
bool AllSame(const std::vector<Request>& rs, F key) {
  for (size_t r = 1; r < rs.size(); ++r) {
    if (key(rs[r]) != key(rs[0])) return false;
  }
  return true;
}

}  // namespace

namespace {

// "Mismatched <what> for <op> '<name>': <who sent what>.", or "" when every
// rank agrees on key(request).
template <typename Key>
std::string Mismatch(const std::vector<Request>& rs, const std::string& what,
                     Key key) {
  if (AllSame(rs, key)) return "";
  return "Mismatched " + what + " for " + std::string(OpTypeName(rs[0].op)) +
         " '" + rs[0].name + "': " + Disagreement(rs, key) + ".";
}

// What every collective must agree on: the operation, the dtype, and host
// or GPU memory. Which GPU need not agree: each process drives its own
// (often each sees it as ordinal 0, but not under TF's visible devices).
std::string CheckKind(const std::vector<Request>& rs) {
  auto op = [](const Request& q) { return std::string(OpTypeName(q.op)); };
  if (!AllSame(rs, op)) {
    return "Mismatched operation for '" + rs[0].name +
           "': " + Disagreement(rs, op) + ".";
  }
  auto dtype = [](const Request& q) {
    return std::string(DataTypeName(q.dtype));
  };
  std::string e = Mismatch(rs, "dtype", dtype);
  if (!e.empty()) return e;
  auto device = [](const Request& q) {
    return std::string(q.device < 0 ? "host memory" : "GPU memory");
  };
  return Mismatch(rs, "device", device);
}

// Reductions: the reduce op, the scale factors and the group; broadcast:
// the root.
std::string CheckArguments(const std::vector<Request>& rs) {
  const OpType t = rs[0].op;
  if (t == OpType::kBroadcast) {
    auto root = [](const Request& q) {
      return "root_rank " + std::to_string(q.root_rank);
    };
    return Mismatch(rs, "root rank", root);
  }
  if (t != OpType::kAllreduce && t != OpType::kReducescatter) return "";
  auto rop = [](const Request& q) {
    return std::string(ReduceOpName(q.reduce_op));
  };
  auto pre = [](const Request& q) { return std::to_string(q.prescale); };
  auto post = [](const Request& q) { return std::to_string(q.postscale); };
  auto grp = [](const Request& q) {
    return q.group.empty()
               ? std::string("no group")
               : "group '" + q.group + "' of " + std::to_string(q.group_size);
  };
  std::string e = Mismatch(rs, "reduction op", rop);
  if (e.empty()) e = Mismatch(rs, "prescale_factor", pre);
  if (e.empty()) e = Mismatch(rs, "postscale_factor", post);
  if (e.empty()) e = Mismatch(rs, "group", grp);
  return e;
}

std::vector<int64_t> Trailing(const Request& q) {
  return std::vector<int64_t>(q.shape.begin() + (q.shape.empty() ? 0 : 1),
                              q.shape.end());
}

// Shapes: equal, except the first dimension of allgather and alltoall,
// whose per-rank sizes go into the response.
std::string CheckShapes(const std::vector<Request>& rs, Response* resp) {
  const OpType t = rs[0].op;
  if (t == OpType::kBarrier) return "";
  if (t != OpType::kAllgather && t != OpType::kAlltoall) {
    auto shape = [](const Request& q) {
      return "shape " + ShapeString(q.shape);
    };
    return Mismatch(rs, "shape", shape);
  }
  auto tail = [](const Request& q) {
    return "shape " + ShapeString(q.shape) + " (rank " +
           std::to_string(q.shape.size()) + ", trailing " +
           ShapeString(Trailing(q)) + ")";
  };
  auto tail_key = [](const Request& q) {
    return std::to_string(q.shape.size()) + ShapeString(Trailing(q));
  };
  if (!AllSame(rs, tail_key)) {
    return "Mismatched shape for " + std::string(OpTypeName(t)) + " '" +
           rs[0].name + "': all dimensions but the first must agree; " +
           Disagreement(rs, tail) + ".";
  }
  for (const Request& q : rs) {
    if (t == OpType::kAllgather) {
      resp->first_dims.push_back(q.shape[0]);
    } else {
      resp->splits_matrix.insert(resp->splits_matrix.end(), q.splits.begin(),
                                 q.splits.end());
    }
  }
  return "";
}

}  // namespace

Response BuildResponse(const std::vector<Request>& rs) {
  Response resp;
  resp.req = rs[0];
  resp.error = CheckKind(rs);
  if (resp.error.empty()) resp.error = CheckArguments(rs);
  if (resp.error.empty()) resp.error = CheckShapes(rs, &resp);
  return resp;
}

// ---- encoding -------------------------------------------------------------

namespace {

class Writer {
 public:
  template <typename T>
  void Pod(T v) {
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void Str(const std::string& s) {
    Pod<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  void Ints(const std::vector<int64_t>& v) {
    Pod<uint32_t>(static_cast<uint32_t>(v.size()));
    out_.append(reinterpret_cast<const char*>(v.data()), v.size() * 8);
  }
  void Req(const Request& q) {
    Str(q.name);
    Pod<int32_t>(static_cast<int32_t>(q.op));
    Pod<int32_t>(static_cast<int32_t>(q.reduce_op));
    Pod<int32_t>(static_cast<int32_t>(q.dtype));
    Ints(q.shape);
    Pod<int32_t>(q.root_rank);
    Pod<double>(q.prescale);
    Pod<double>(q.postscale);
    Ints(q.splits);
    Str(q.group);
    Pod<int32_t>(q.group_size);
    Pod<int32_t>(q.device);
  }
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  template <typename T>
  bool Pod(T* v) {
    if (pos_ + sizeof(T) > s_.size()) return false;
    std::memcpy(v, s_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool Str(std::string* v) {
    uint32_t n;
    if (!Pod(&n) || pos_ + n > s_.size()) return false;
    v->assign(s_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool Ints(std::vector<int64_t>* v) {
    uint32_t n;
    if (!Pod(&n) || pos_ + n * 8ull > s_.size()) return false;
    v->resize(n);
    std::memcpy(v->data(), s_.data() + pos_, n * 8ull);
    pos_ += n * 8ull;
    return true;
  }
  bool Req(Request* q) {
    int32_t op = 0, rop = 0, dt = 0;
    bool ok = Str(&q->name) && Pod(&op) && Pod(&rop) && Pod(&dt) &&
              Ints(&q->shape) && Pod(&q->root_rank) && Pod(&q->prescale) &&
              Pod(&q->postscale) && Ints(&q->splits) && Str(&q->group) &&
              Pod(&q->group_size) && Pod(&q->device);
    q->op = static_cast<OpType>(op);
    q->reduce_op = static_cast<ReduceOp>(rop);
    q->dtype = static_cast<DataType>(dt);
    return ok;
  }
  bool Done() const { return pos_ == s_.size(); }

 private:
  const std::string& s_;
  size_t pos_ = 0;
};

Status Corrupt() {
  return Status::Internal("corrupt negotiation message (kerasdist bug)");
}

}  // namespace

std::string Serialize(const RankMessage& m) {
  Writer w;
  w.Pod<uint8_t>(m.shutdown ? 1 : 0);
  w.Pod<uint32_t>(static_cast<uint32_t>(m.cached.size()));
  for (int32_t c : m.cached) w.Pod<int32_t>(c);
  w.Pod<uint32_t>(static_cast<uint32_t>(m.requests.size()));
  for (const auto& q : m.requests) w.Req(q);
  return std::move(w.out_);
}

Status Deserialize(const std::string& bytes, RankMessage* m) {
  Reader r(bytes);
  uint8_t sd;
  uint32_t n;
  if (!r.Pod(&sd) || !r.Pod(&n)) return Corrupt();
  m->shutdown = sd != 0;
  m->cached.resize(n);
  for (auto& c : m->cached) {
    if (!r.Pod(&c)) return Corrupt();
  }
  if (!r.Pod(&n)) return Corrupt();
  m->requests.resize(n);
  for (auto& q : m->requests) {
    if (!r.Req(&q)) return Corrupt();
  }
  return r.Done() ? Status::OK() : Corrupt();
}

std::string Serialize(const CoordinatorMessage& m) {
  Writer w;
  w.Pod<uint8_t>(m.shutdown ? 1 : 0);
  w.Str(m.shutdown_reason);
  w.Pod<uint32_t>(static_cast<uint32_t>(m.batches.size()));
  for (const auto& b : m.batches) {
    w.Pod<uint32_t>(static_cast<uint32_t>(b.cache_index.size()));
    for (size_t i = 0; i < b.cache_index.size(); ++i) {
      w.Pod<int32_t>(b.cache_index[i]);
      if (b.cache_index[i] < 0) {
        const Response& r = b.responses[i];
        w.Req(r.req);
        w.Str(r.error);
        w.Ints(r.first_dims);
        w.Ints(r.splits_matrix);
      }
    }
  }
  return std::move(w.out_);
}

Status Deserialize(const std::string& bytes, CoordinatorMessage* m) {
  Reader r(bytes);
  uint8_t sd;
  uint32_t nb;
  if (!r.Pod(&sd) || !r.Str(&m->shutdown_reason) || !r.Pod(&nb)) {
    return Corrupt();
  }
  m->shutdown = sd != 0;
  m->batches.resize(nb);
  for (auto& b : m->batches) {
    uint32_t n;
    if (!r.Pod(&n)) return Corrupt();
    b.cache_index.resize(n);
    b.responses.resize(n);
    for (uint32_t i = 0; i < n; ++i) {
      if (!r.Pod(&b.cache_index[i])) return Corrupt();
      if (b.cache_index[i] < 0) {
        Response& x = b.responses[i];
        if (!r.Req(&x.req) || !r.Str(&x.error) || !r.Ints(&x.first_dims) ||
            !r.Ints(&x.splits_matrix)) {
          return Corrupt();
        }
      }
    }
  }
  return r.Done() ? Status::OK() : Corrupt();
}

}  // namespace kerasdist::core
