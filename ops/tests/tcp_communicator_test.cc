// The TCP transport (tcp_mesh.h, tcp_communicator.h) over real sockets on
// loopback, ranks as threads each with its own listener and connections:
// every collective against values computed here, and its contract: a peer
// that closes, freezes or calls something else fails the others (never a
// wait forever) naming it; a connection that does not prove the job's key,
// or comes from another generation, never joins the mesh.
#include <unistd.h>

#include <chrono>
#include <exception>
#include <functional>
#include <numeric>
#include <thread>

#include "../core/control/hmac.h"
#include "../core/transport/sockets.h"
#include "../core/transport/tcp_communicator.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;
using Seconds = std::chrono::duration<double>;

// Rank r's element i: small integers, exact in float32 sums.
float Value(int r, int64_t i) { return static_cast<float>((r + 1) * (i % 97)); }

void CheckAllreduce(TcpCommunicator& comm, int64_t count) {
  const int n = comm.size();
  std::vector<float> buf(count);
  for (int64_t i = 0; i < count; ++i) buf[i] = Value(comm.rank(), i);
  CHECK_OK(
      comm.Allreduce(buf.data(), count, DataType::kFloat32, ReduceOp::kSum));
  for (int64_t i = 0; i < count; ++i) {
    CHECK_MSG(
        buf[i] == n * (n + 1) / 2 * static_cast<float>(i % 97),
        "count " + std::to_string(count) + " element " + std::to_string(i));
  }
  std::vector<int32_t> v{comm.rank(), -comm.rank()};
  CHECK_OK(comm.Allreduce(v.data(), 2, DataType::kInt32, ReduceOp::kMax));
  CHECK(v[0] == n - 1 && v[1] == 0);
}

void CheckGathers(TcpCommunicator& comm) {
  const int n = comm.size(), r = comm.rank();
  std::vector<int64_t> bytes(n);
  for (int p = 0; p < n; ++p) bytes[p] = p == 1 ? 0 : 3 + p;  // one empty
  const int64_t total = std::accumulate(bytes.begin(), bytes.end(), int64_t{0});
  std::vector<char> mine(bytes[r], static_cast<char>('a' + r));
  std::string want;
  for (int p = 0; p < n; ++p) want += std::string(bytes[p], 'a' + p);
  std::vector<char> out(total, '?');
  CHECK_OK(comm.Allgatherv(mine.data(), out.data(), bytes));
  CHECK(std::string(out.begin(), out.end()) == want);
  for (int root = 0; root < n; ++root) {
    std::vector<char> got(total, '?');
    CHECK_OK(comm.Gatherv(mine.data(), got.data(), bytes, root));
    if (r == root) CHECK(std::string(got.begin(), got.end()) == want);
    std::vector<int64_t> b(5, r == root ? 40 + root : -1);
    CHECK_OK(comm.Broadcast(b.data(), 5 * 8, root));
    CHECK(b[4] == 40 + root);
  }
}

void CheckReducescatterAndAlltoall(TcpCommunicator& comm) {
  const int n = comm.size(), r = comm.rank();
  std::vector<int64_t> counts(n);
  for (int p = 0; p < n; ++p) counts[p] = p == 0 ? 0 : 2 * p + 1;
  const int64_t total =
      std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<int64_t> in(total), out(counts[r], -1);
  for (int64_t i = 0; i < total; ++i) in[i] = (r + 1) * 1000 + i;
  CHECK_OK(comm.Reducescatter(in.data(), out.data(), counts, DataType::kInt64,
                              ReduceOp::kSum));
  int64_t first =
      std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
  for (int64_t i = 0; i < counts[r]; ++i) {
    CHECK(out[i] == 1000 * n * (n + 1) / 2 + n * (first + i));
  }
  // Alltoall: rank r sends p + 1 bytes of ('A' + r) to rank p.
  std::vector<int64_t> send(n), recv(n);
  std::string sent, want;
  for (int p = 0; p < n; ++p) {
    send[p] = p + 1;
    recv[p] = r + 1;
    sent += std::string(p + 1, 'A' + r);
    want += std::string(r + 1, 'A' + p);
  }
  std::string got(want.size(), '?');
  CHECK_OK(comm.Alltoallv(sent.data(), send, &got[0], recv));
  CHECK(got == want);
  CHECK_OK(comm.Barrier());
  int32_t token = r, from = -1;
  CHECK_OK(comm.SendRecv(&token, 4, (r + 1) % n, &from, 4, (r + n - 1) % n));
  CHECK(from == (r + n - 1) % n);
}

KD_TEST(TcpCollectivesGiveWhatTheyShould) {
  for (int n = 1; n <= 4; ++n) {
    RunTcpRanks(n, [&](TcpCommunicator& comm) {
      // Fewer elements than ranks, uneven blocks, and more than a segment.
      for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{1000},
                            2 * TcpCommunicator::kSegmentBytes / 4 + 13}) {
        CheckAllreduce(comm, count);
      }
      if (n > 1) CheckGathers(comm);
      if (n > 1) CheckReducescatterAndAlltoall(comm);
    });
  }
}

// Hosts interleaved by rank: a node's ranks in rank order, the leaders
// each host's first rank, hosts in the order of their first rank.
KD_TEST(TcpNodeCommunicatorsFollowTheHostNames) {
  const std::vector<std::string> hosts = {"b", "a", "b", "a", "a"};
  TcpJob job = ListenTcp(5);
  RunThreads(5, [&](int r) {
    TcpMeshOptions opt = job.opt;
    opt.rank = r;
    std::unique_ptr<TcpMesh> mesh;
    CHECK_OK(TcpMesh::Form(opt, job.listeners[r], &mesh));
    std::unique_ptr<Communicator> all, node, leaders;
    MakeNodeCommunicators(std::move(mesh), hosts, &all, &node, &leaders);
    CHECK(all->rank() == r && all->size() == 5);
    const std::vector<int> b = {0, 2}, a = {1, 3, 4};
    const std::vector<int>& mine = hosts[r] == "b" ? b : a;
    CHECK(node->size() == static_cast<int>(mine.size()));
    CHECK(mine[node->rank()] == r);
    CHECK((leaders != nullptr) == (r == 0 || r == 1));
    if (leaders) CHECK(leaders->size() == 2 && leaders->rank() == r);
    int32_t v = r;  // the node's ranks summed
    CHECK_OK(node->Allreduce(&v, 1, DataType::kInt32, ReduceOp::kSum));
    CHECK(v == (hosts[r] == "b" ? 2 : 8));
    CHECK_OK(all->Barrier());
  });
  for (int fd : job.listeners) close(fd);
}

KD_TEST(TcpPeerThatClosesFailsItsPeersNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  RunTcpRanks(3, [&](TcpCommunicator& comm) {
    std::vector<float> buf(1000, 1.0f);
    CHECK_OK(
        comm.Allreduce(buf.data(), 1000, DataType::kFloat32, ReduceOp::kSum));
    if (comm.rank() == 2) {
      comm.mesh().Abort("test: it left");
      Status s = comm.Barrier();
      CHECK(s.code() == StatusCode::kAborted);
      CHECK_CONTAINS(s.message(), "test: it left");
      return;
    }
    Status s =
        comm.Allreduce(buf.data(), 1000, DataType::kFloat32, ReduceOp::kSum);
    CHECK(s.code() == StatusCode::kRanksLost);
    CHECK_CONTAINS(s.message(), "closed its connection");
    // The mesh is broken: a later call fails with the same error.
    Status again = comm.Barrier();
    CHECK(again.message() == s.message());
  });
  CHECK(Seconds(std::chrono::steady_clock::now() - start).count() < 5);
}

KD_TEST(TcpFrozenPeerFailsItsPeersAfterTheTimeout) {
  RunTcpRanks(
      2,
      [&](TcpCommunicator& comm) {
        if (comm.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        Status s = comm.Barrier();
        const double took =
            Seconds(std::chrono::steady_clock::now() - start).count();
        CHECK(s.code() == StatusCode::kRanksLost);
        CHECK_CONTAINS(s.message(), "rank 1 sent nothing for 1 s");
        CHECK_MSG(took > 0.9 && took < 2.4, std::to_string(took));
      },
      [](TcpMeshOptions& opt) { opt.timeout_s = 1; });
}

KD_TEST(TcpDisagreeingCallsFailNamingBothSides) {
  RunTcpRanks(2, [&](TcpCommunicator& comm) {
    std::vector<float> buf(16, 1.0f);
    Status s =
        comm.rank() == 0
            ? comm.Allreduce(buf.data(), 16, DataType::kFloat32, ReduceOp::kSum)
            : comm.Broadcast(buf.data(), 24, 1);
    if (comm.rank() == 0) {  // rank 1's send may well have gone
      CHECK(s.code() == StatusCode::kMismatch);
      CHECK_CONTAINS(s.message(),
                     "expected 64 bytes of allreduce from rank 1, "
                     "which sent 24 bytes of broadcast");
    }
  });
}

// Forms rank 0's and rank 1's meshes of `job` side by side (rank 1's
// options changed by `tweak`); their statuses.
std::vector<Status> FormBoth(
    const TcpJob& job, std::vector<std::unique_ptr<TcpMesh>>* meshes,
    const std::function<void(TcpMeshOptions&)>& tweak = nullptr) {
  std::vector<Status> got(2);
  meshes->resize(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      TcpMeshOptions opt = job.opt;
      opt.rank = r;
      if (r == 1 && tweak) tweak(opt);
      got[r] = TcpMesh::Form(opt, job.listeners[r], &(*meshes)[r]);
    });
  }
  for (auto& t : ranks) t.join();
  return got;
}

KD_TEST(TcpMeshAdmitsOnlyRanksThatProveTheKey) {
  // A stranger's garbage and an idle connection at rank 0's port while the
  // mesh forms: the mesh forms anyway, without them.
  TcpJob job = ListenTcp(2);
  std::string port = job.opt.addresses[0].substr(10);
  std::thread stranger([&] {
    int idle = ConnectWithTimeout("127.0.0.1", std::stoi(port), 1.0);
    int noisy = ConnectWithTimeout("127.0.0.1", std::stoi(port), 1.0);
    CHECK(idle >= 0 && noisy >= 0);
    SendAll(noisy, std::string(200, 'x'), 1.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    close(idle);
    close(noisy);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::vector<std::unique_ptr<TcpMesh>> meshes;
  std::vector<Status> got = FormBoth(job, &meshes);
  stranger.join();
  CHECK_OK(got[0]);
  CHECK_OK(got[1]);
  TcpCommunicator a(std::move(meshes[0])), b(std::move(meshes[1]));
  int32_t x = 5, y = 6;
  std::thread other(
      [&] { CHECK_OK(b.Allreduce(&y, 1, DataType::kInt32, ReduceOp::kSum)); });
  CHECK_OK(a.Allreduce(&x, 1, DataType::kInt32, ReduceOp::kSum));
  other.join();
  CHECK(x == 11 && y == 11);
  for (int fd : job.listeners) close(fd);
}

// A foreign client that knows the hello's format (nothing in it is
// secret) but not the key: its proof is refused and it never joins.
KD_TEST(TcpMeshRefusesAHelloWhoseProofIsWrong) {
  TcpJob job = ListenTcp(2);
  job.opt.connect_timeout_s = 1.0;
  std::thread stranger([&] {
    const int port = std::stoi(job.opt.addresses[0].substr(10));
    int fd = ConnectWithTimeout("127.0.0.1", port, 1.0);
    CHECK(fd >= 0);
    std::string hello = "kdtm";
    auto put = [&](const void* p, size_t n) {
      hello.append(static_cast<const char*>(p), n);
    };
    const uint32_t version = 1, channel = TcpMeshOptions::kData;
    const uint64_t generation = job.opt.generation;
    const int32_t from = 1, to = 0;
    put(&version, 4);
    put(&channel, 4);
    put(&generation, 8);
    put(&from, 4);
    put(&to, 4);
    hello += std::string(32, 'n');  // its nonce
    std::string answer;
    CHECK(SendAll(fd, hello, 1.0));
    CHECK(ReadExactly(fd, 64, 1.0, &answer));       // the listener's proof
    CHECK(SendAll(fd, std::string(32, 'p'), 1.0));  // not a proof
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    close(fd);
  });
  TcpMeshOptions opt = job.opt;
  opt.rank = 0;
  std::unique_ptr<TcpMesh> mesh;
  Status s = TcpMesh::Form(opt, job.listeners[0], &mesh);
  stranger.join();
  for (int fd : job.listeners) close(fd);
  CHECK(s.code() == StatusCode::kRanksLost);
  CHECK_CONTAINS(s.message(),
                 "rank 1 did not connect within 1 s (last refused: it did "
                 "not prove the job's key");
}

KD_TEST(TcpMeshRefusesAWrongKeyAnotherGenerationAndChannel) {
  for (int which = 0; which < 3; ++which) {
    TcpJob job = ListenTcp(2);
    job.opt.connect_timeout_s = 1.0;
    std::vector<std::unique_ptr<TcpMesh>> meshes;
    std::vector<Status> got = FormBoth(job, &meshes, [&](TcpMeshOptions& opt) {
      if (which == 0) opt.key = "another job's key";
      if (which == 1) opt.generation = 6;  // a mesh before
      if (which == 2) opt.channel = TcpMeshOptions::kControl;
    });
    for (int fd : job.listeners) close(fd);
    CHECK(!got[0].ok() && !got[1].ok());
    CHECK_CONTAINS(got[0].message(), "rank 1 did not connect within 1 s");
    if (which == 0) {
      CHECK_CONTAINS(got[1].message(), "did not prove the job's key");
    } else {
      CHECK_CONTAINS(got[0].message(),
                     which == 1
                         ? "a hello of generation 6, this mesh's is 7"
                         : "a hello for channel 1, this listener's is 0");
      CHECK_CONTAINS(got[1].message(), "could not connect to rank 0");
    }
  }
}

}  // namespace
}  // namespace kdtest
