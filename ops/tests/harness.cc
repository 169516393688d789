#include "harness.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kdtest {

namespace {

struct Test {
  const char* name;
  void (*fn)();
};

std::vector<Test>& Tests() {
  static std::vector<Test> tests;
  return tests;
}

// Runs one test; prints its line and returns whether it passed.
bool RunOne(const Test& t) {
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    t.fn();
  } catch (const Failure& f) {
    error = f.what;
  } catch (const std::exception& e) {
    error = std::string("exception: ") + e.what();
  }
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start)
                        .count();
  if (error.empty()) {
    std::printf("[ OK ] %s (%.1f ms)\n", t.name, ms);
  } else {
    std::printf("[FAIL] %s (%.1f ms)\n  %s\n", t.name, ms, error.c_str());
  }
  std::fflush(stdout);
  return error.empty();
}

}  // namespace

void Fail(const char* file, int line, const std::string& what) {
  throw Failure{std::string(file) + ":" + std::to_string(line) + ": " + what};
}

void Register(const char* name, void (*fn)()) { Tests().push_back({name, fn}); }

// Runs body(r) on `n` threads and rethrows the first rank's failure after
// every thread has ended.
void RunThreads(int n, const std::function<void(int)>& body) {
  std::mutex mu;
  std::string first;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const Failure& f) {
        std::lock_guard<std::mutex> l(mu);
        if (first.empty()) first = "rank " + std::to_string(r) + ": " + f.what;
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> l(mu);
        if (first.empty())
          first = "rank " + std::to_string(r) + ": exception: " + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!first.empty())
    throw Failure{"with " + std::to_string(n) + " ranks, " + first};
}

void RunRanks(
    int n, const std::function<void(kerasdist::core::LocalCommunicator&)>& fn,
    double timeout_s) {
  auto group = std::make_shared<kerasdist::core::LocalGroup>(n, timeout_s);
  RunThreads(n, [&](int r) {
    // Destroyed on the way out, failure or not: peers then fail, naming r.
    kerasdist::core::LocalCommunicator comm(group, r);
    fn(comm);
  });
}

void RunHosts(const std::vector<int>& hosts,
              const std::function<void(HostRanks&)>& fn, double timeout_s) {
  using kerasdist::core::LocalCommunicator;
  using kerasdist::core::LocalGroup;
  std::vector<int> host_of, first_of;  // by rank; by host
  for (size_t h = 0; h < hosts.size(); ++h) {
    first_of.push_back(static_cast<int>(host_of.size()));
    for (int i = 0; i < hosts[h]; ++i) host_of.push_back(static_cast<int>(h));
  }
  const int n = static_cast<int>(host_of.size());
  auto all = std::make_shared<LocalGroup>(n, timeout_s);
  auto leaders =
      std::make_shared<LocalGroup>(static_cast<int>(hosts.size()), timeout_s);
  std::vector<std::shared_ptr<LocalGroup>> nodes;
  for (int size : hosts)
    nodes.push_back(std::make_shared<LocalGroup>(size, timeout_s));
  RunThreads(n, [&](int r) {
    const int h = host_of[r], node_rank = r - first_of[h];
    LocalCommunicator comm(all, r), node(nodes[h], node_rank);
    std::unique_ptr<LocalCommunicator> lead;
    if (node_rank == 0) lead = std::make_unique<LocalCommunicator>(leaders, h);
    HostRanks ranks{&comm, &node, lead.get()};
    fn(ranks);
    // Leaving ends the group for all: wait until every rank is done (two
    // ranks may still exchange messages when a third has finished).
    CHECK_OK(comm.Barrier());
  });
}

TcpJob ListenTcp(int n) {
  using kerasdist::core::TcpMesh;
  TcpJob job;
  job.opt.size = n;
  job.opt.key = "the job's key";
  job.opt.generation = 7;
  job.opt.connect_timeout_s = 10;
  job.opt.timeout_s = 10;
  for (int r = 0; r < n; ++r) {
    int fd = -1, port = 0;
    CHECK_OK(TcpMesh::Listen("127.0.0.1", &fd, &port));
    job.listeners.push_back(fd);
    job.opt.addresses.push_back("127.0.0.1:" + std::to_string(port));
  }
  return job;
}

void RunTcpRanks(
    int n, const std::function<void(kerasdist::core::TcpCommunicator&)>& fn,
    const std::function<void(kerasdist::core::TcpMeshOptions&)>& tweak) {
  using namespace kerasdist::core;
  TcpJob job = ListenTcp(n);
  RunThreads(n, [&](int r) {
    TcpMeshOptions opt = job.opt;
    opt.rank = r;
    if (tweak) tweak(opt);
    std::unique_ptr<TcpMesh> mesh;
    CHECK_OK(TcpMesh::Form(opt, job.listeners[r], &mesh));
    TcpCommunicator comm(std::move(mesh));
    fn(comm);
  });
  for (int fd : job.listeners) close(fd);
}

void RunTcpHosts(const std::vector<int>& hosts,
                 const std::function<void(HostRanks&)>& fn) {
  using namespace kerasdist::core;
  std::vector<std::string> names;
  for (size_t h = 0; h < hosts.size(); ++h) {
    for (int i = 0; i < hosts[h]; ++i)
      names.push_back("host" + std::to_string(h));
  }
  const int n = static_cast<int>(names.size());
  TcpJob job = ListenTcp(n);
  RunThreads(n, [&](int r) {
    TcpMeshOptions opt = job.opt;
    opt.rank = r;
    std::unique_ptr<TcpMesh> mesh;
    CHECK_OK(TcpMesh::Form(opt, job.listeners[r], &mesh));
    std::unique_ptr<Communicator> all, node, leaders;
    MakeNodeCommunicators(std::move(mesh), names, &all, &node, &leaders);
    HostRanks ranks{all.get(), node.get(), leaders.get()};
    fn(ranks);
    CHECK_OK(all->Barrier());  // every rank done before any closes
  });
  for (int fd : job.listeners) close(fd);
}

void ReceiveControl(kerasdist::core::ControlChannel& c, int* src,
                    std::string* bytes) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bool got = false;
  while (!got) {
    CHECK_OK(c.PollControl(&got, src, bytes));
    CHECK_MSG(got || std::chrono::steady_clock::now() < until,
              "no control message within 5 s");
    if (!got) std::this_thread::yield();
  }
}

}  // namespace kdtest

int main(int argc, char** argv) {
  auto& tests = kdtest::Tests();
  if (argc == 2 && std::strcmp(argv[1], "--list") == 0) {
    for (const auto& t : tests) std::printf("%s\n", t.name);
    return 0;
  }
  if (argc == 3 && std::strcmp(argv[1], "--run") == 0) {
    for (const auto& t : tests) {
      if (std::strcmp(t.name, argv[2]) == 0) return kdtest::RunOne(t) ? 0 : 1;
    }
    std::fprintf(stderr, "no test named '%s'; --list shows them\n", argv[2]);
    return 2;
  }
  if (argc != 1) {
    std::fprintf(stderr, "usage: %s [--list | --run NAME]\n", argv[0]);
    return 2;
  }
  int failed = 0;
  for (const auto& t : tests) failed += kdtest::RunOne(t) ? 0 : 1;
  std::printf("%zu tests, %d failed\n", tests.size(), failed);
  return failed == 0 ? 0 : 1;
}
