// A job's TCP context (tcp_context.h): its topology from host names as
// MPI's split by node gives it, both meshes formed over real sockets on
// loopback, and a revocation that fails every rank's pending call.
#include <unistd.h>

#include <chrono>
#include <exception>
#include <thread>

#include "../core/transport/tcp_context.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;
using Seconds = std::chrono::duration<double>;

void CheckTopology(const std::vector<std::string>& hosts, int rank,
                   Topology want) {
  const Topology t = TopologyOf(hosts, rank);
  CHECK_MSG(
      t.rank == want.rank && t.size == want.size &&
          t.local_rank == want.local_rank && t.local_size == want.local_size &&
          t.cross_rank == want.cross_rank && t.cross_size == want.cross_size,
      "rank " + std::to_string(rank) + ": local " +
          std::to_string(t.local_rank) + "/" + std::to_string(t.local_size) +
          ", cross " + std::to_string(t.cross_rank) + "/" +
          std::to_string(t.cross_size));
}

KD_TEST(TcpTopologyIsMpisSplitByNode) {
  const std::vector<std::string> even = {"x", "x", "y", "y"};
  CheckTopology(even, 0, {0, 4, 0, 2, 0, 2});
  CheckTopology(even, 3, {3, 4, 1, 2, 1, 2});
  const std::vector<std::string> uneven = {"a", "b", "a", "a"};
  CheckTopology(uneven, 1, {1, 4, 0, 1, 1, 2});
  CheckTopology(uneven, 2, {2, 4, 1, 3, 0, 1});
  CheckTopology(uneven, 3, {3, 4, 2, 3, 0, 1});
}

// Forms a context per rank on threads (host h's ranks named "host<h>" as
// `hosts` says) and runs fn on each; rethrows the first failure.
void RunContexts(const std::vector<std::string>& hosts,
                 const std::function<void(TcpContext&)>& fn) {
  const int n = static_cast<int>(hosts.size());
  TcpJob data = ListenTcp(n), control = ListenTcp(n);
  RunThreads(n, [&](int r) {
    TcpContextOptions opt;
    opt.mesh = data.opt;
    opt.mesh.rank = r;
    opt.control_addresses = control.opt.addresses;
    opt.host = hosts[r];
    std::unique_ptr<TcpContext> ctx;
    CHECK_OK(
        TcpContext::Form(opt, data.listeners[r], control.listeners[r], &ctx));
    fn(*ctx);
  });
  for (int fd : data.listeners) close(fd);
  for (int fd : control.listeners) close(fd);
}

KD_TEST(TcpContextFormsAndCarriesAStep) {
  const std::vector<std::string> hosts = {"x", "x", "y", "y"};
  RunContexts(hosts, [&](TcpContext& ctx) {
    const Topology& t = ctx.topology();
    CHECK(ctx.hosts() == hosts);
    CHECK(t.size == 4 && t.local_size == 2 && t.cross_size == 2);
    CHECK(t.local_rank == t.rank % 2 && t.cross_rank == t.rank / 2);
    std::unique_ptr<Communicator> all, node, leaders;
    ctx.MakeCommunicators(&all, &node, &leaders);
    CHECK((leaders != nullptr) == (t.local_rank == 0));
    std::vector<double> g(1000, t.rank + 1.0);  // a gradient, averaged
    CHECK_OK(
        all->Allreduce(g.data(), 1000, DataType::kFloat64, ReduceOp::kSum));
    CHECK(g[999] == 10.0);
    // The negotiation's round: every worker reports, rank 0 answers.
    int src = -1;
    std::string bytes;
    bool got = false;
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::seconds(5);
    auto receive = [&] {
      got = false;
      while (!got && std::chrono::steady_clock::now() < until) {
        CHECK_OK(ctx.PollControl(&got, &src, &bytes));
      }
      CHECK_MSG(got, "no control message within 5 s");
    };
    if (t.rank != 0) {
      CHECK_OK(ctx.SendControl(0, "ready " + std::to_string(t.rank)));
      receive();
      CHECK(src == 0 && bytes == "go");
    } else {
      for (int k = 1; k < 4; ++k) {
        receive();
        CHECK(bytes == "ready " + std::to_string(src));
      }
      for (int r = 1; r < 4; ++r) CHECK_OK(ctx.SendControl(r, "go"));
      ctx.FlushSends(5.0);
    }
    CHECK_OK(all->Barrier());
  });
}

KD_TEST(TcpContextRevokeFailsEveryRanksPendingCall) {
  const auto start = std::chrono::steady_clock::now();
  RunContexts({"x", "x", "y"}, [&](TcpContext& ctx) {
    std::unique_ptr<Communicator> all, node, leaders;
    ctx.MakeCommunicators(&all, &node, &leaders);
    const int me = ctx.topology().rank;
    std::thread revoker;
    if (me == 0) {  // another thread revokes while this one waits
      revoker = std::thread([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        ctx.Revoke("test: a rank was lost");
      });
    }
    if (me == 2) std::this_thread::sleep_for(std::chrono::milliseconds(400));
    // Rank 2 comes late: rank 0 is revoked inside the barrier; a rank may
    // still get through it (every rank had entered), but no rank gets
    // through the collective after.
    Status s = all->Barrier();
    if (revoker.joinable()) revoker.join();
    int32_t v = 1;
    Status after = all->Allreduce(&v, 1, DataType::kInt32, ReduceOp::kSum);
    CHECK_MSG(after.code() == StatusCode::kRanksLost,
              "rank " + std::to_string(me) + ": " + after.message());
    if (me == 0) {
      CHECK_CONTAINS(s.message(), "revoked: test: a rank was lost");
      bool got = true;
      int src = -1;
      std::string bytes;
      Status c = ctx.PollControl(&got, &src, &bytes);
      CHECK(!got && c.code() == StatusCode::kRanksLost);
      CHECK_CONTAINS(c.message(), "revoked: test: a rank was lost");
    }
  });
  CHECK(Seconds(std::chrono::steady_clock::now() - start).count() < 5);
}

}  // namespace
}  // namespace kdtest
