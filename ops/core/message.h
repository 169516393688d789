// What ranks tell the coordinator (Request) and what it decides (Response),
// and their byte encoding for the negotiation messages.
#ifndef KERASDIST_CORE_MESSAGE_H_
#define KERASDIST_CORE_MESSAGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "status.h"
#include "types.h"

namespace kerasdist::core {

struct Request {
  std::string name;
  OpType op = OpType::kAllreduce;
  ReduceOp reduce_op = ReduceOp::kSum;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  int32_t root_rank = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> splits;  // alltoall: rows sent to each rank
  std::string group;            // grouped allreduce: reduced together
  int32_t group_size = 0;
  int32_t device = -1;  // -1 = host memory, else a GPU ordinal

  bool operator==(const Request& o) const;
  bool operator!=(const Request& o) const { return !(*this == o); }
};

// The coordinator's decision for one tensor. `error` non-empty fails it on
// every rank. For allgather, `first_dims[r]` is rank r's first dimension; for
// alltoall, `splits_matrix[r * size + s]` is what rank r sends to rank s.
struct Response {
  Request req;  // as rank 0 asked (shape and splits are rank 0's)
  std::string error;
  std::vector<int64_t> first_dims;
  std::vector<int64_t> splits_matrix;
};

// Rebuilds what `rank` asked for when the response is a cache hit for it.
Request RequestForRank(const Response& r, int rank, int size);
// RequestForRank(r, rank, size) == q, without building a copy where the
// request is the same on every rank (all but allgather and alltoall).
bool MatchesForRank(const Response& r, int rank, int size, const Request& q);

// Coordinator-side validation of the requests of every rank for one tensor.
// Returns a response whose `error` names the tensor, what differed and the
// ranks.
Response BuildResponse(const std::vector<Request>& per_rank);

// Rank -> coordinator: tensors newly pending here, as cache indices where the
// request equals the cached one, as full requests otherwise.
struct RankMessage {
  bool shutdown = false;
  std::vector<int32_t> cached;
  std::vector<Request> requests;
};

// Coordinator -> every rank: batches to execute in this order. Each batch runs
// as one collective (several tensors when fused). An item is a cache index
// (>= 0) or -1 with a full response in `responses`.
struct Batch {
  std::vector<int32_t> cache_index;
  std::vector<Response>
      responses;  // parallel to cache_index (empty when cached)
};
struct CoordinatorMessage {
  bool shutdown = false;
  std::string shutdown_reason;
  std::vector<Batch> batches;
};

std::string Serialize(const RankMessage& m);
std::string Serialize(const CoordinatorMessage& m);
Status Deserialize(const std::string& bytes, RankMessage* m);
Status Deserialize(const std::string& bytes, CoordinatorMessage* m);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_MESSAGE_H_
