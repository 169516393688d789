// Pure functions: Tensor Fusion planning, request validation, layouts.
#include <cmath>
#include <limits>

#include "../core/fusion.h"
#include "../core/layout.h"
#include "../core/validate.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

Response Resp(const std::string& name, int64_t elements,
              DataType dt = DataType::kFloat32, ReduceOp op = ReduceOp::kSum,
              OpType type = OpType::kAllreduce) {
  Response r;
  r.req.name = name;
  r.req.shape = {elements};
  r.req.dtype = dt;
  r.req.reduce_op = op;
  r.req.op = type;
  return r;
}

using Plan = std::vector<std::vector<int>>;

KD_TEST(FusionRespectsTheThreshold) {
  // float32: 40, 40, 40, 400, 20 bytes under a 100-byte threshold.
  std::vector<Response> rs = {Resp("a", 10), Resp("b", 10), Resp("c", 10),
                              Resp("big", 100), Resp("d", 5)};
  CHECK((PlanFusion(rs, 100) == Plan{{0, 1, 4}, {2}, {3}}));
  // A tensor exactly at the threshold travels alone; 0 turns fusion off.
  CHECK((PlanFusion(rs, 40) == Plan{{0}, {1}, {2}, {3}, {4}}));
  CHECK((PlanFusion(rs, 0) == Plan{{0}, {1}, {2}, {3}, {4}}));
  CHECK((PlanFusion(rs, 1 << 20) == Plan{{0, 1, 2, 3, 4}}));
  CHECK(PlanFusion(std::vector<Response>(), 100).empty());
}

KD_TEST(FusionKeepsKindsApartAndOrder) {
  Response scaled = Resp("s", 1);
  scaled.req.prescale = 0.5;
  Response device = Resp("gpu", 1);
  device.req.device = 0;
  Response failed = Resp("err", 1);
  failed.error = "Mismatched dtype";
  std::vector<Response> rs = {
      Resp("f0", 1),
      Resp("i0", 1, DataType::kInt32),
      Resp("max", 1, DataType::kFloat32, ReduceOp::kMax),
      scaled,
      device,
      failed,
      Resp("bc", 1, DataType::kFloat32, ReduceOp::kSum, OpType::kBroadcast),
      Resp("f1", 1),
      Resp("i1", 1, DataType::kInt32),
      Resp("max1", 1, DataType::kFloat32, ReduceOp::kMax)};
  // Each kind fuses with its own; errors and other collectives travel
  // alone; batches ordered by their first member.
  CHECK((PlanFusion(rs, 1 << 20) ==
         Plan{{0, 7}, {1, 8}, {2, 9}, {3}, {4}, {5}, {6}}));
}

Request Valid(OpType op) {
  Request q;
  q.name = "t";
  q.op = op;
  q.shape = {4, 2};
  return q;
}

std::string Problem(const Request& q, int size = 2, bool device = false) {
  Status s = ValidateRequest(q, size, device);
  CHECK(s.ok() || s.code() == StatusCode::kInvalidArgument);
  return s.message();
}

KD_TEST(ValidationRules) {
  for (OpType op : {OpType::kAllreduce, OpType::kAllgather, OpType::kBroadcast,
                    OpType::kReducescatter, OpType::kBarrier}) {
    CHECK_MSG(Problem(Valid(op)).empty(), Problem(Valid(op)));
  }
  Request q = Valid(OpType::kAllreduce);
  q.name = "";
  CHECK_CONTAINS(
      Problem(q),
      "needs a name that is the same on all ranks; got an empty name");

  for (OpType op : {OpType::kAllreduce, OpType::kReducescatter}) {
    q = Valid(op);
    q.dtype = DataType::kBool;
    CHECK_CONTAINS(Problem(q),
                   "'t': bool tensors cannot be reduced; cast to int32 first.");
  }
  q = Valid(OpType::kAllgather);
  q.dtype = DataType::kBool;
  CHECK(Problem(q).empty());

  q = Valid(OpType::kBroadcast);
  for (int root : {-1, 2}) {
    q.root_rank = root;
    CHECK_CONTAINS(Problem(q),
                   "broadcast 't': root_rank must be in [0, 2), got " +
                       std::to_string(root));
  }
  q = Valid(OpType::kAllgather);
  q.shape = {};
  CHECK_CONTAINS(
      Problem(q),
      "allgather 't' needs a tensor of at least one dimension; got a scalar.");

  q = Valid(OpType::kAllreduce);
  q.shape = {3, -1};
  CHECK_CONTAINS(Problem(q), "allreduce 't': negative dimension in [3, -1].");

  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    q = Valid(OpType::kAllreduce);
    q.postscale = bad;
    CHECK_CONTAINS(Problem(q), "scale factors must be finite");
    q = Valid(OpType::kAllreduce);
    q.prescale = bad;
    CHECK_CONTAINS(Problem(q), "scale factors must be finite");
  }

  q = Valid(OpType::kAllreduce);
  q.device = 0;
  CHECK_CONTAINS(Problem(q, 2, false), "no GPU backend");
  CHECK(Problem(q, 2, true).empty());
}

KD_TEST(AdasumRules) {
  // What Horovod takes: float16/32/64 allreduces on 1, 2, 4, ... ranks.
  Request q = Valid(OpType::kAllreduce);
  q.reduce_op = ReduceOp::kAdasum;
  for (DataType dt :
       {DataType::kFloat16, DataType::kFloat32, DataType::kFloat64}) {
    q.dtype = dt;
    for (int size : {1, 2, 4, 8}) CHECK(Problem(q, size).empty());
  }
  for (DataType dt : {DataType::kInt32, DataType::kInt64, DataType::kUInt8,
                      DataType::kBFloat16}) {
    q.dtype = dt;
    CHECK_CONTAINS(Problem(q),
                   std::string("allreduce 't': the Adasum reduction takes "
                               "float16, float32 or float64 tensors; got ") +
                       DataTypeName(dt));
  }
  q.dtype = DataType::kFloat32;
  for (int size : {3, 5, 6, 12}) {
    CHECK_CONTAINS(Problem(q, size),
                   "needs a power-of-two number of ranks (as in Horovod); "
                   "this job has " +
                       std::to_string(size));
  }
  q.device = 0;
  CHECK_CONTAINS(Problem(q, 2, true), "runs on host memory only");
  q = Valid(OpType::kReducescatter);
  q.reduce_op = ReduceOp::kAdasum;
  CHECK_CONTAINS(Problem(q),
                 "reducescatter 't': the Adasum reduction is only for "
                 "allreduce");
  // Fusion keeps Adasum tensors apart from sums.
  std::vector<Response> rs = {
      Resp("a0", 1, DataType::kFloat32, ReduceOp::kAdasum), Resp("s0", 1),
      Resp("a1", 1, DataType::kFloat32, ReduceOp::kAdasum)};
  CHECK((PlanFusion(rs, 1 << 20) == Plan{{0, 2}, {1}}));
}

KD_TEST(AlltoallSplits) {
  Request q = Valid(OpType::kAlltoall);
  q.splits = {1, 3};
  CHECK(Problem(q).empty());
  q.splits = {4};
  CHECK_CONTAINS(
      Problem(q),
      "alltoall 't': splits must have one entry per rank (2), got 1.");
  q.splits = {5, -1};
  CHECK_CONTAINS(Problem(q), "splits must be >= 0, got [5, -1].");
  q.splits = {1, 2};
  CHECK_CONTAINS(Problem(q),
                 "splits [1, 2] add up to 3 but the first dimension is 4.");

  // Without splits: equal ones where the first dimension divides evenly.
  q = Valid(OpType::kAlltoall);
  CHECK_OK(PrepareRequest(q, 2, false));
  CHECK((q.splits == std::vector<int64_t>{2, 2}));
  q = Valid(OpType::kAlltoall);
  Status s = PrepareRequest(q, 3, false);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_CONTAINS(s.message(),
                 "the first dimension (4) must be divisible by the number of "
                 "ranks (3); pass splits.");
}

KD_TEST(ReducescatterLayoutGivesEarlierRanksTheExtraRows) {
  Request q = Valid(OpType::kReducescatter);
  q.shape = {7, 3};
  const std::vector<int64_t> rows = {3, 2, 2};
  for (int r = 0; r < 3; ++r) {
    Layout l = ReducescatterLayout(q, r, 3);
    CHECK((l.counts == std::vector<int64_t>{9, 6, 6}));
    CHECK((l.out_shape == std::vector<int64_t>{rows[r], 3}));
  }
}

}  // namespace
}  // namespace kdtest
