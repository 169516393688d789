// The heartbeat (core/control/liveness.h) over real loopback TCP, in one
// process: a coordinator and workers on threads, with on_lost capturing the
// line that would end the process.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "../core/control/liveness.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

// The line on_lost gets, waited for with a bound.
struct Said {
  std::mutex mu;
  std::condition_variable cv;
  std::string line;
  void Set(const std::string& l) {
    std::lock_guard<std::mutex> g(mu);
    line = l;
    cv.notify_all();
  }
  std::string Wait(double seconds) {
    std::unique_lock<std::mutex> g(mu);
    cv.wait_for(g, std::chrono::duration<double>(seconds),
                [&] { return !line.empty(); });
    return line;
  }
};

LivenessOptions Options(int rank, int size, Said* said) {
  LivenessOptions o;
  o.rank = rank;
  o.size = size;
  o.hosts = {"node1", "node2", "node2"};
  o.hosts.resize(size, "node2");
  o.interval_s = 0.05;
  o.timeout_s = 0.5;
  o.on_lost = [said](const std::string& l) { said->Set(l); };
  o.key = "the job's key";
  return o;
}

int Connected(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  CHECK(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
  return fd;
}

// A job of three on `port`: rank 0's coordinator on this thread, workers 1
// and 2 on another after `first` ran there; formed within 4 s.
void FormJob(int listen_fd, int port, Said said[3],
             std::unique_ptr<Liveness> live[3],
             const std::function<void()>& first) {
  std::thread t([&] {
    first();
    CHECK_OK(Liveness::StartWorker(Options(1, 3, &said[1]), {"127.0.0.1"}, port,
                                   &live[1]));
    CHECK_OK(Liveness::StartWorker(Options(2, 3, &said[2]), {"127.0.0.1"}, port,
                                   &live[2]));
  });
  const auto start = std::chrono::steady_clock::now();
  CHECK_OK(
      Liveness::StartCoordinator(Options(0, 3, &said[0]), listen_fd, &live[0]));
  t.join();
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(4));
}

// A worker that says hello and then nothing: frozen from the start.
int SilentWorker(int port, int rank) {
  int fd = Connected(port);
  Said unused;
  CHECK_OK(Liveness::Handshake(fd, Options(rank, 3, &unused), 5.0));
  return fd;
}

KD_TEST(DescribeLostNamesAWholeHostOrEachRank) {
  const std::vector<std::string> hosts = {"a", "b", "b", "c"};
  CHECK_CONTAINS(
      DescribeLost(hosts, {{2, LostReason::kSilent}, {1, LostReason::kSilent}},
                   30),
      "host b (ranks 1, 2): no heartbeat for 30 s");
  CHECK_CONTAINS(DescribeLost(hosts, {{2, LostReason::kClosed}}, 30),
                 "rank 2 on host b: its connection closed without a goodbye");
  const std::string two = DescribeLost(
      hosts, {{3, LostReason::kClosed}, {1, LostReason::kSilent}}, 5);
  CHECK_CONTAINS(two, "rank 1 on host b: no heartbeat for 5 s");
  CHECK_CONTAINS(two, "; host c (rank 3): its connection closed");
}

KD_TEST(LivenessFindsASilentWorkerAndTellsTheOthers) {
  int listen_fd = -1, port = -1;
  CHECK_OK(Liveness::Listen("127.0.0.1", &listen_fd, &port));
  Said said0, said1;
  std::unique_ptr<Liveness> worker;
  int silent = -1;
  std::thread t([&] {
    CHECK_OK(Liveness::StartWorker(Options(1, 3, &said1), {"127.0.0.1"}, port,
                                   &worker));
    silent = SilentWorker(port, 2);
  });
  std::unique_ptr<Liveness> coordinator;
  CHECK_OK(Liveness::StartCoordinator(Options(0, 3, &said0), listen_fd,
                                      &coordinator));
  t.join();
  CHECK_CONTAINS(
      said0.Wait(5.0),
      "kerasdist: rank 0: lost rank 2 on host node2: no heartbeat for 0.5 s");
  CHECK_CONTAINS(said1.Wait(5.0),
                 "kerasdist: rank 1: lost rank 2 on host node2: no heartbeat");
  close(silent);
}

KD_TEST(LivenessTellsAGoodbyeFromADeath) {
  int listen_fd = -1, port = -1;
  CHECK_OK(Liveness::Listen("127.0.0.1", &listen_fd, &port));
  Said said0, said1;
  std::unique_ptr<Liveness> worker, coordinator;
  int dying = -1;
  std::thread t([&] {
    // An address that does not parse is skipped for the next.
    CHECK_OK(Liveness::StartWorker(
        Options(1, 3, &said1), {"not-an-address", "127.0.0.1"}, port, &worker));
    dying = SilentWorker(port, 2);
  });
  CHECK_OK(Liveness::StartCoordinator(Options(0, 3, &said0), listen_fd,
                                      &coordinator));
  t.join();
  worker->Stop();  // rank 1 says goodbye: it must not be named below
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  close(dying);  // rank 2 as a process that died: closed, no goodbye
  const std::string line = said0.Wait(5.0);
  CHECK_CONTAINS(
      line,
      "lost rank 2 on host node2: its connection closed without a goodbye");
  CHECK(line.find("rank 1 ") == std::string::npos);
  CHECK(said1.line.empty());
}

// A job of one rank (no port, no peer): the thread only feeds the
// watchdog pipe, "arm", a beat each interval, "off" when stopped.
KD_TEST(LivenessAloneOnlyFeedsTheWatchdog) {
  int fds[2];
  CHECK(pipe(fds) == 0);
  Said said;
  LivenessOptions o = Options(0, 1, &said);
  o.watchdog_fd = fds[1];
  std::unique_ptr<Liveness> alone;
  CHECK_OK(Liveness::StartCoordinator(o, -1, &alone));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  alone->Stop();
  close(fds[1]);
  std::string fed;
  char buf[256];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) fed.append(buf, n);
  close(fds[0]);
  CHECK_CONTAINS(fed, "arm 0.5");
  CHECK_CONTAINS(fed, "beat\nbeat\nbeat\n");
  CHECK(fed.size() >= 4 && fed.substr(fed.size() - 4) == "off\n");
  CHECK(said.line.empty());
}

// Foreign connections on rank 0's port while the workers connect: idle
// ones, half a hello, a forged 16-byte hello (the old protocol), a hello
// with a wrong proof. None counts as a rank, none delays the real ones.
KD_TEST(LivenessCountsOnlyConnectionsThatProveTheKey) {
  int listen_fd = -1, port = -1;
  CHECK_OK(Liveness::Listen("127.0.0.1", &listen_fd, &port));
  std::vector<int> foreign;
  for (int i = 0; i < Liveness::kMaxPending + 10; ++i) {
    foreign.push_back(Connected(port));  // idle, half-open
  }
  int forged = Connected(port);
  uint32_t hello[4] = {1, 2, 0, 0x6b646862};
  CHECK(send(forged, hello, sizeof(hello), 0) == sizeof(hello));
  Said said[3];
  std::unique_ptr<Liveness> live[3];
  int wrong = -1;
  Status wrong_key = Status::OK();
  FormJob(listen_fd, port, said, live, [&] {
    // Another job's key: rank 0 does not prove itself to it, nor it to
    // rank 0.
    wrong = Connected(port);
    Said unused;
    LivenessOptions other = Options(2, 3, &unused);
    other.key = "another job's key";
    wrong_key = Liveness::Handshake(wrong, other, 5.0);
  });
  CHECK_CONTAINS(wrong_key.message(),
                 "did not prove the job's key (another job's, or not "
                 "kerasdist's); check that every rank of the job has the "
                 "same KERASDIST_JOB_SECRET");
  // The foreign connections end: none was a peer, so none is lost, while
  // the real workers keep beating.
  for (int fd : foreign) close(fd);
  close(forged);
  close(wrong);
  CHECK(said[0].Wait(1.5).empty());
  CHECK(said[1].line.empty() && said[2].line.empty());
  for (auto& l : live) l->Stop();
}

std::string BoundAddress(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  CHECK(getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0);
  char text[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &sa.sin_addr, text, sizeof(text));
  return text;
}

// Rank 0's heartbeat port listens where the ranks reach it: loopback when
// they all share its network namespace, the --network-interface's address
// when it has one, else every interface.
KD_TEST(LivenessListensWhereTheRanksReachIt) {
  CHECK(Liveness::ListenAddress(true, "") == "127.0.0.1");
  CHECK(Liveness::ListenAddress(true, "no-such-if0") == "127.0.0.1");
  CHECK(Liveness::ListenAddress(false, "lo") == "127.0.0.1");
  CHECK(Liveness::ListenAddress(false, "no-such-if0") == "");
  CHECK(Liveness::ListenAddress(false, "") == "");
  int fd = -1, port = -1;
  CHECK_OK(Liveness::Listen("127.0.0.1", &fd, &port));
  CHECK(BoundAddress(fd) == "127.0.0.1" && port > 0);
  close(fd);
  CHECK_OK(Liveness::Listen("", &fd, &port));
  CHECK(BoundAddress(fd) == "0.0.0.0");
  close(fd);
  CHECK_CONTAINS(Liveness::Listen("eth0", &fd, &port).message(),
                 "'eth0' is not an IPv4 address");
}

// A bounded fuzz of the heartbeat port's parser: for as long as the job
// forms, clients send it random bytes and mutated hellos (flipped bytes of
// a real one, a real one cut short) and hang up. The job forms within its
// bound, no line of a lost rank is said anywhere, and the workers beat on.
KD_TEST(LivenessShrugsOffRandomAndMutatedBytes) {
  int listen_fd = -1, port = -1;
  CHECK_OK(Liveness::Listen("127.0.0.1", &listen_fd, &port));
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread fuzz([&] {
    std::mt19937 rng(20261203);
    const uint32_t hello[4] = {1, 3, 0, 0x6b646862};
    while (!stop.load()) {
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(port);
      inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
      if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
        std::string bytes;
        switch (rng() % 3) {
          case 0:  // random bytes
            bytes.resize(1 + rng() % 256);
            for (char& c : bytes) c = static_cast<char>(rng());
            break;
          case 1:  // a hello with flipped bytes
            bytes.assign(reinterpret_cast<const char*>(hello), sizeof(hello));
            for (int k = 0; k < 3; ++k) bytes[rng() % bytes.size()] ^= rng();
            break;
          default:  // a hello cut short
            bytes.assign(reinterpret_cast<const char*>(hello),
                         1 + rng() % (sizeof(hello) - 1));
        }
        if (send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) > 0) ++sent;
      }
      close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  Said said[3];
  std::unique_ptr<Liveness> live[3];
  FormJob(listen_fd, port, said, live,
          [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); });
  // The fuzz goes on while the job beats, past the heartbeat's timeout.
  CHECK(said[0].Wait(1.0).empty());
  stop = true;
  fuzz.join();
  CHECK(sent.load() > 50);
  CHECK(said[0].Wait(0.6).empty());
  CHECK(said[1].line.empty() && said[2].line.empty());
  for (auto& l : live) l->Stop();
}

}  // namespace
}  // namespace kdtest
