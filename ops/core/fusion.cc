#include "fusion.h"

namespace kerasdist::core {

namespace {

bool Fusible(const Response& r) {
  return r.error.empty() && r.req.op == OpType::kAllreduce;
}

bool SameKind(const Request& a, const Request& b) {
  return a.dtype == b.dtype && a.reduce_op == b.reduce_op &&
         a.prescale == b.prescale && a.postscale == b.postscale &&
         (a.device >= 0) == (b.device >= 0);  // a rank has one GPU
}

int64_t Bytes(const Request& q) {
  return NumElements(q.shape) * DataTypeSize(q.dtype);
}

}  // namespace

std::vector<std::vector<int>> PlanFusion(const std::vector<Response>& ready,
                                         int64_t threshold_bytes) {
  std::vector<const Response*> ptrs;
  ptrs.reserve(ready.size());
  for (const Response& r : ready) ptrs.push_back(&r);
  return PlanFusion(ptrs, threshold_bytes);
}

std::vector<std::vector<int>> PlanFusion(
    const std::vector<const Response*>& ready, int64_t threshold_bytes) {
  std::vector<std::vector<int>> batches;
  std::vector<int64_t> bytes;  // fill of each batch; -1 = closed to fusion
  for (int i = 0; i < static_cast<int>(ready.size()); ++i) {
    const Response& r = *ready[i];
    int64_t b = Bytes(r.req);
    if (Fusible(r) && threshold_bytes > 0 && b < threshold_bytes) {
      bool placed = false;
      for (size_t k = 0; k < batches.size() && !placed; ++k) {
        if (bytes[k] < 0) continue;
        const Request& head = ready[batches[k][0]]->req;
        if (SameKind(head, r.req) && bytes[k] + b <= threshold_bytes) {
          batches[k].push_back(i);
          bytes[k] += b;
          placed = true;
        }
      }
      if (placed) continue;
      batches.push_back({i});
      bytes.push_back(b);
    } else {
      batches.push_back({i});
      bytes.push_back(-1);
    }
  }
  return batches;
}

}  // namespace kerasdist::core
