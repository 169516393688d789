// The in-process communicator's own contract: a rank that leaves, is
// stuck, or calls something else makes its peers fail (never wait forever),
// naming it.
#include <chrono>
#include <thread>

#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;
using Ms = std::chrono::milliseconds;

KD_TEST(RankThatLeavesFailsItsPeers) {
  for (int n = 2; n <= 4; ++n) {
    RunRanks(n, [&](LocalCommunicator& comm) {
      std::vector<float> buf(8, 1.0f);
      CHECK_OK(
          comm.Allreduce(buf.data(), 8, DataType::kFloat32, ReduceOp::kSum));
      CHECK(buf[0] == static_cast<float>(n));
      if (comm.rank() == n - 1) {
        std::this_thread::sleep_for(Ms(10));  // the others are waiting by now
        comm.Abort("test: it gave up");
        Status s = comm.Barrier();
        CHECK(s.code() == StatusCode::kAborted);
        CHECK_CONTAINS(s.message(), "left its local group");
        return;
      }
      // A pending call, and a later one, fail naming the rank that left.
      for (int i = 0; i < 2; ++i) {
        Status s =
            comm.Allreduce(buf.data(), 8, DataType::kFloat32, ReduceOp::kSum);
        CHECK(s.code() == StatusCode::kAborted);
        CHECK_CONTAINS(s.message(), "rank " + std::to_string(n - 1) +
                                        " left the group (test: it gave up)");
      }
    });
  }
}

KD_TEST(DestroyedCommunicatorCountsAsLeaving) {
  auto group = std::make_shared<LocalGroup>(2, 5.0);
  Status got;
  std::thread peer([&] {
    LocalCommunicator comm(group, 0);
    got = comm.Barrier();
  });
  {
    LocalCommunicator gone(group, 1);
  }
  peer.join();
  CHECK(got.code() == StatusCode::kAborted);
  CHECK_CONTAINS(got.message(),
                 "rank 1 left the group (its LocalCommunicator was destroyed)");
}

KD_TEST(StuckRankTimesOutNamingIt) {
  // Rank 2 never calls: the others give up after the group's timeout.
  const auto start = std::chrono::steady_clock::now();
  RunRanks(
      3,
      [&](LocalCommunicator& comm) {
        if (comm.rank() == 2) {
          std::this_thread::sleep_for(Ms(150));
          return;
        }
        Status s = comm.Barrier();
        CHECK(s.code() == StatusCode::kAborted);
        CHECK_CONTAINS(s.message(),
                       "rank(s) 2 did not reach barrier within 0.1");
      },
      0.1);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}

KD_TEST(DisagreeingCallsFailOnEveryRank) {
  RunRanks(3, [&](LocalCommunicator& comm) {
    std::vector<int32_t> buf(4, 1);
    const int64_t count = comm.rank() == 2 ? 3 : 4;
    Status s =
        comm.Allreduce(buf.data(), count, DataType::kInt32, ReduceOp::kSum);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_CONTAINS(s.message(),
                   "ranks disagree on the count of allreduce: rank 0 passed 4, "
                   "rank 2 passed 3");
    CHECK(buf[0] == 1);  // untouched
    // Different collectives at the same point.
    s = comm.rank() == 1 ? comm.Barrier() : comm.Broadcast(buf.data(), 16, 0);
    CHECK_CONTAINS(s.message(),
                   "rank 0 passed broadcast, rank 1 passed barrier");
    // Average never reaches a communicator.
    s = comm.Allreduce(buf.data(), 4, DataType::kInt32, ReduceOp::kAverage);
    CHECK_CONTAINS(s.message(), "Average never reaches a communicator");
    // Alltoall sizes that do not pair up name both ranks.
    std::vector<int64_t> send(3, 4), recv(3, 4);
    if (comm.rank() == 0) recv[1] = 8;
    std::vector<char> in(12), out(16);
    s = comm.Alltoallv(in.data(), send, out.data(), recv);
    CHECK_CONTAINS(s.message(),
                   "rank 1 sends 4 bytes to rank 0, which expects 8");
    // The group still works after argument errors.
    CHECK_OK(comm.Barrier());
  });
}

KD_TEST(SendRecvAroundARingAndGatherv) {
  for (int n = 2; n <= 4; ++n) {
    RunRanks(n, [&](LocalCommunicator& comm) {
      const int me = comm.rank(), right = (me + 1) % n, left = (me + n - 1) % n;
      // Rank r sends r + 1 ints to the right.
      std::vector<int32_t> send(me + 1, me), recv(left + 1, -1);
      for (int round = 0; round < 3; ++round) {
        CHECK_OK(comm.SendRecv(send.data(), send.size() * 4, right, recv.data(),
                               recv.size() * 4, left));
        CHECK(recv == std::vector<int32_t>(left + 1, left));
      }
      // Gatherv lands on the root only.
      std::vector<int64_t> bytes;
      for (int r = 0; r < n; ++r) bytes.push_back((r + 1) * 4);
      std::vector<int32_t> all(n * (n + 1) / 2, -1);
      CHECK_OK(comm.Gatherv(send.data(), all.data(), bytes, 1));
      size_t at = 0;
      for (int r = 0; r < n; ++r) {
        for (int i = 0; i <= r; ++i, ++at) CHECK(all[at] == (me == 1 ? r : -1));
      }
    });
  }
}

KD_TEST(SendRecvOfTheWrongSizeFailsNamingIt) {
  RunRanks(2, [&](LocalCommunicator& comm) {
    const int peer = 1 - comm.rank();
    std::vector<char> buf(8);
    Status s = comm.SendRecv(buf.data(), comm.rank() == 0 ? 8 : 4, peer,
                             buf.data(), 8, peer);
    CHECK(s.code() == StatusCode::kAborted);
    CHECK_CONTAINS(s.message(), "rank 1 sends 4 bytes, 8 expected");
  });
}

}  // namespace
}  // namespace kdtest
