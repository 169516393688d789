// The control plane over TCP (tcp_control.h), used as the runtime uses
// MpiContext's: workers report to rank 0, which answers every rank; over
// real sockets on loopback, a control mesh beside each rank's data mesh.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "../core/message.h"
#include "../core/transport/tcp_control.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

// Rank `rank`'s control mesh of `job` (listeners of its own).
std::unique_ptr<TcpMesh> ControlMesh(const TcpJob& job, int rank) {
  TcpMeshOptions opt = job.opt;
  opt.rank = rank;
  opt.channel = TcpMeshOptions::kControl;
  std::unique_ptr<TcpMesh> mesh;
  CHECK_OK(TcpMesh::Form(opt, job.listeners[rank], &mesh));
  return mesh;
}

void CloseListeners(const TcpJob& job) {
  for (int fd : job.listeners) close(fd);
}

KD_TEST(TcpControlMessagesArriveInOrderPerSender) {
  const int kPerRank = 20;
  const std::string big(3 << 20, 'x');  // more than a socket's buffer
  for (int n = 1; n <= 4; ++n) {
    TcpJob control = ListenTcp(n);
    control.opt.channel = TcpMeshOptions::kControl;
    RunTcpRanks(n, [&](TcpCommunicator& comm) {
      const int me = comm.rank();
      TcpControl channel(ControlMesh(control, me));
      bool got = true;
      int src = -1;
      std::string bytes;
      CHECK_OK(channel.PollControl(&got, &src, &bytes));
      CHECK(!got);               // nothing yet, and no wait
      CHECK_OK(comm.Barrier());  // before any rank sends
      if (me != 0) {
        for (int i = 0; i < kPerRank; ++i) {
          RankMessage m;
          m.cached.push_back(i);
          CHECK_OK(channel.SendControl(0, Serialize(m)));
        }
        CHECK_OK(channel.SendControl(0, big));
        ReceiveControl(channel, &src, &bytes);
        CHECK(src == 0 && bytes == "done " + std::to_string(me));
      } else {
        std::vector<int> next(n, 0);
        for (int k = 0; k < (kPerRank + 1) * (n - 1); ++k) {
          ReceiveControl(channel, &src, &bytes);
          if (next[src] == kPerRank) {
            CHECK_MSG(bytes == big,
                      "the big message from rank " + std::to_string(src));
            ++next[src];
            continue;
          }
          RankMessage m;
          CHECK_OK(Deserialize(bytes, &m));
          CHECK_MSG(m.cached == std::vector<int32_t>{next[src]++},
                    "out of order from rank " + std::to_string(src));
        }
        for (int r = 1; r < n; ++r)
          CHECK_OK(channel.SendControl(r, "done " + std::to_string(r)));
        channel.FlushSends(5.0);
      }
      CHECK_OK(comm.Barrier());  // nobody leaves before the answers are read
    });
    CloseListeners(control);
  }
}

KD_TEST(TcpControlDeliversAGoodbyeThenFailsSendsToTheClosedPeer) {
  TcpJob control = ListenTcp(2);
  control.opt.channel = TcpMeshOptions::kControl;
  RunTcpRanks(2, [&](TcpCommunicator& comm) {
    std::unique_ptr<TcpControl> channel(
        new TcpControl(ControlMesh(control, comm.rank())));
    if (comm.rank() == 1) {
      CHECK_OK(channel->SendControl(0, "bye"));
      channel->FlushSends(5.0);
      channel.reset();  // closes its connections
      CHECK_OK(comm.Barrier());
      return;
    }
    int src = -1;
    std::string bytes;
    ReceiveControl(*channel, &src, &bytes);
    CHECK(src == 1 && bytes == "bye");
    CHECK_OK(comm.Barrier());  // rank 1's end is written by now
    bool got = true;
    CHECK_OK(channel->PollControl(&got, &src, &bytes));
    CHECK(!got);
    // The first send may land in the socket's buffer; the reset that
    // answers it fails a later one.
    Status s;
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (s.ok() && std::chrono::steady_clock::now() < until) {
      s = channel->SendControl(1, "decision");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHECK(s.code() == StatusCode::kRanksLost);
    CHECK_CONTAINS(s.message(),
                   "control: rank 0: rank 1 closed its connection");
  });
  CloseListeners(control);
}

KD_TEST(TcpControlRefusesWhatIsNotAFrame) {
  TcpJob control = ListenTcp(2);
  control.opt.channel = TcpMeshOptions::kControl;
  RunTcpRanks(2, [&](TcpCommunicator& comm) {
    std::unique_ptr<TcpMesh> mesh = ControlMesh(control, comm.rank());
    if (comm.rank() == 1) {
      const std::string junk = "not a frame at all";
      CHECK(send(mesh->fd(0), junk.data(), junk.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(junk.size()));
      CHECK_OK(comm.Barrier());
      return;
    }
    TcpControl channel(std::move(mesh));
    CHECK_OK(comm.Barrier());
    bool got = false;
    int src = -1;
    std::string bytes;
    Status s = channel.PollControl(&got, &src, &bytes);
    CHECK(!got && s.code() == StatusCode::kRanksLost);
    CHECK_CONTAINS(s.message(),
                   "rank 1 sent something that is not a control frame");
    // Broken from then on.
    CHECK(channel.SendControl(1, "x").message() == s.message());
  });
  CloseListeners(control);
}

}  // namespace
}  // namespace kdtest
