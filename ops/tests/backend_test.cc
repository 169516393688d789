// CommunicatorBackend over the in-process communicator, N in {1, 2, 3, 4}
// ranks as threads: every collective against a serial reference computed
// here with plain loops; and how the backend list chooses.
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>

#include "../core/backends/backend.h"
#include "../core/backends/communicator_backend.h"
#include "../core/scale.h"
#include "harness.h"
#include "reduce_cases.h"
#include "values.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

KD_TEST(AllreduceEveryDtypeOpAndScaling) {
  for (int n = 1; n <= 4; ++n) {
    const std::vector<ReduceCase> cases = AllreduceCases(n);
    RunRanks(n, [&](LocalCommunicator& comm) {
      CommunicatorBackend backend("local", &comm, comm.rank());
      for (const ReduceCase& c : cases)
        RunAllreduceCase(backend, c, comm.rank(), n);
    });
  }
}

// One rank: the self backend gives what the communicator path gives.
KD_TEST(SelfBackendMatchesTheReference) {
  SelfBackend self(1);
  for (const ReduceCase& c : AllreduceCases(1)) RunAllreduceCase(self, c, 0, 1);
}

KD_TEST(AllgatherUnevenSizes) {
  for (int n = 1; n <= 4; ++n) {
    RunRanks(n, [&](LocalCommunicator& comm) {
      const int me = comm.rank();
      const int64_t row = 3;
      auto rows = [](int r) {
        return static_cast<int64_t>((r + 2) % 3);
      };  // 2, 0, 1, 2
      std::vector<int64_t> recv_bytes;
      int64_t total = 0;
      for (int r = 0; r < n; ++r) {
        recv_bytes.push_back(rows(r) * row * 4);
        total += rows(r) * row;
      }
      std::vector<char> in(rows(me) * row * 4), out(total * 4);
      for (int64_t i = 0; i < rows(me) * row; ++i)
        Put(in, i, DataType::kInt32, me * 100 + i);
      const std::string name = "gather";
      CollectiveBatch b;
      b.op = OpType::kAllgather;
      b.dtype = DataType::kInt32;
      b.tensors.push_back({&name, in.data(), out.data(), rows(me) * row});
      b.recv_bytes = recv_bytes;
      CommunicatorBackend backend("local", &comm, me);
      CHECK_OK(backend.Run(b, 0));
      int64_t k = 0;
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < rows(r) * row; ++i, ++k) {
          CHECK_MSG(Get(out, k, DataType::kInt32) == r * 100 + i,
                    "element " + std::to_string(k));
        }
      }
    });
  }
}

KD_TEST(BroadcastFromEveryRoot) {
  for (int n = 1; n <= 4; ++n) {
    RunRanks(n, [&](LocalCommunicator& comm) {
      const int me = comm.rank();
      CommunicatorBackend backend("local", &comm, me);
      const std::string name = "bcast";
      for (int root = 0; root < n; ++root) {
        for (bool in_place : {false, true}) {
          const int64_t count = 7;
          std::vector<char> in(count * 8), out(count * 8, 0);
          for (int64_t i = 0; i < count; ++i)
            Put(in, i, DataType::kFloat64, me * 10 + i + 0.5);
          const std::vector<char> kept = in;
          CollectiveBatch b;
          b.op = OpType::kBroadcast;
          b.dtype = DataType::kFloat64;
          b.root_rank = root;
          b.tensors.push_back(
              {&name, in.data(), in_place ? in.data() : out.data(), count});
          CHECK_OK(backend.Run(b, 0));
          const std::vector<char>& got = in_place ? in : out;
          for (int64_t i = 0; i < count; ++i) {
            CHECK_MSG(Get(got, i, DataType::kFloat64) == root * 10 + i + 0.5,
                      "root " + std::to_string(root) + " element " +
                          std::to_string(i));
          }
          if (!in_place) CHECK_MSG(in == kept, "the input changed");
        }
      }
    });
  }
}

KD_TEST(AlltoallUnevenSplits) {
  for (int n = 1; n <= 4; ++n) {
    RunRanks(n, [&](LocalCommunicator& comm) {
      const int me = comm.rank();
      const int64_t row = 2;  // int32 elements per row
      auto split = [](int from, int to) {
        return static_cast<int64_t>((from + 2 * to) % 3);
      };
      // Row k sent from `from` to `to` holds from*1000 + to*100 + k*2 + j.
      auto cell = [](int from, int to, int64_t k, int64_t j) {
        return static_cast<double>(from * 1000 + to * 100 + k * 2 + j);
      };
      std::vector<int64_t> send_bytes, recv_bytes;
      int64_t send_rows = 0, recv_rows = 0;
      for (int r = 0; r < n; ++r) {
        send_bytes.push_back(split(me, r) * row * 4);
        recv_bytes.push_back(split(r, me) * row * 4);
        send_rows += split(me, r);
        recv_rows += split(r, me);
      }
      std::vector<char> in(send_rows * row * 4), out(recv_rows * row * 4);
      int64_t e = 0;
      for (int to = 0; to < n; ++to) {
        for (int64_t k = 0; k < split(me, to); ++k) {
          for (int64_t j = 0; j < row; ++j)
            Put(in, e++, DataType::kInt32, cell(me, to, k, j));
        }
      }
      const std::string name = "a2a";
      CollectiveBatch b;
      b.op = OpType::kAlltoall;
      b.dtype = DataType::kInt32;
      b.tensors.push_back({&name, in.data(), out.data(), send_rows * row});
      b.send_bytes = send_bytes;
      b.recv_bytes = recv_bytes;
      CommunicatorBackend backend("local", &comm, me);
      CHECK_OK(backend.Run(b, 0));
      e = 0;
      for (int from = 0; from < n; ++from) {
        for (int64_t k = 0; k < split(from, me); ++k) {
          for (int64_t j = 0; j < row; ++j, ++e) {
            CHECK_MSG(Get(out, e, DataType::kInt32) == cell(from, me, k, j),
                      "element " + std::to_string(e) + " from rank " +
                          std::to_string(from));
          }
        }
      }
    });
  }
}

KD_TEST(ReducescatterUnevenCounts) {
  for (int n = 1; n <= 4; ++n) {
    for (DataType dt :
         {DataType::kFloat32, DataType::kInt32, DataType::kFloat16}) {
      RunRanks(n, [&](LocalCommunicator& comm) {
        const int me = comm.rank();
        const bool fl = IsFloat(dt);
        const int64_t rows = 2 * n + 1, per_row = 2;  // uneven for n > 1
        std::vector<int64_t> counts;
        for (int r = 0; r < n; ++r)
          counts.push_back((rows / n + (r < rows % n ? 1 : 0)) * per_row);
        int64_t offset = 0;
        for (int r = 0; r < me; ++r) offset += counts[r];
        // Floats: prescale 0.5 and postscale 2; integers: Average (divisor n).
        ReduceCase c{dt, ReduceOp::kSum, fl ? 0.5 : 1.0, fl ? 2.0 : 1.0,
                     fl ? 1 : n};
        std::vector<char> in(rows * per_row * Size(dt)),
            out(counts[me] * Size(dt));
        for (int64_t i = 0; i < rows * per_row; ++i)
          Put(in, i, dt, Value(me, 0, i, dt));
        const std::string name = "rs";
        CollectiveBatch b;
        b.op = OpType::kReducescatter;
        b.dtype = dt;
        b.reduce_op = c.op;
        b.prescale = c.pre;
        b.postscale = c.post;
        b.divisor = c.divisor;
        b.counts = counts;
        b.tensors.push_back({&name, in.data(), out.data(), rows * per_row});
        CommunicatorBackend backend("local", &comm, me);
        CHECK_OK(backend.Run(b, 0));
        for (int64_t i = 0; i < counts[me]; ++i) {
          const double want = Expected(c, n, 0, offset + i),
                       have = Get(out, i, dt);
          CHECK_MSG(std::fabs(have - want) <=
                        Tolerance(dt) * std::max(1.0, std::fabs(want)),
                    std::string(DataTypeName(dt)) + " element " +
                        std::to_string(i) + " is " + std::to_string(have) +
                        ", expected " + std::to_string(want));
        }
      });
    }
  }
}

KD_TEST(BarrierWaitsForEveryRank) {
  for (int n = 1; n <= 4; ++n) {
    std::atomic<int> before{0};
    RunRanks(n, [&](LocalCommunicator& comm) {
      // The last rank comes late: nobody may pass before it arrives.
      if (comm.rank() == n - 1)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      before.fetch_add(1);
      const std::string name = "barrier";
      CollectiveBatch b;
      b.op = OpType::kBarrier;
      CommunicatorBackend backend("local", &comm, comm.rank());
      CHECK_OK(backend.Run(b, 0));
      CHECK_MSG(before.load() == n, "passed the barrier with " +
                                        std::to_string(before.load()) + " of " +
                                        std::to_string(n) + " ranks arrived");
    });
  }
}

// ---- The backend list ----------------------------------------------------

CollectiveBatch HostBatch(OpType op, int device = -1) {
  CollectiveBatch b;
  b.op = op;
  b.device = device;
  return b;
}

KD_TEST(ChooseBackendTakesTheFirstEnabled) {
  auto group = std::make_shared<LocalGroup>(1);
  LocalCommunicator comm(group, 0);
  BackendList list;
  list.push_back(std::make_unique<SelfBackend>(1));
  list.push_back(std::make_unique<CommunicatorBackend>("first", &comm, 0));
  list.push_back(std::make_unique<CommunicatorBackend>("second", &comm, 0));
  // One rank: the self backend wins for allreduce only; the first host
  // backend takes the rest; nothing runs device tensors.
  CHECK(
      std::string(ChooseBackend(list, HostBatch(OpType::kAllreduce))->Name()) ==
      "self");
  for (OpType op : {OpType::kAllgather, OpType::kBroadcast, OpType::kAlltoall,
                    OpType::kReducescatter, OpType::kBarrier}) {
    CHECK(std::string(ChooseBackend(list, HostBatch(op))->Name()) == "first");
  }
  CHECK(ChooseBackend(list, HostBatch(OpType::kAllreduce, 0)) == nullptr);
  // With two ranks the self backend steps aside.
  BackendList two;
  two.push_back(std::make_unique<SelfBackend>(2));
  two.push_back(std::make_unique<CommunicatorBackend>("mpi", &comm, 0));
  CHECK(
      std::string(ChooseBackend(two, HostBatch(OpType::kAllreduce))->Name()) ==
      "mpi");
  CHECK(ChooseBackend(BackendList(), HostBatch(OpType::kAllreduce)) == nullptr);
}

KD_TEST(UnimplementedCollectiveNamesBackendAndCollective) {
  SelfBackend self(1);
  for (OpType op : {OpType::kAllgather, OpType::kBroadcast, OpType::kAlltoall,
                    OpType::kReducescatter, OpType::kBarrier}) {
    CollectiveBatch b = HostBatch(op);
    Status s = self.Run(b, 0);
    CHECK(s.code() == StatusCode::kInternal);
    CHECK_CONTAINS(s.message(), "'self' backend");
    CHECK_CONTAINS(s.message(),
                   std::string("does not implement ") + OpTypeName(op));
  }
}

}  // namespace
}  // namespace kdtest
