// A small test harness for the core's C++ tests: a registry of named tests,
// CHECK macros that fail the test (throwing out of it, so a failing rank
// thread leaves its group and its peers fail instead of waiting), and
// RunRanks, which runs one function per rank on threads over a LocalGroup
// (RunHosts: with a group per simulated host and one of the hosts' leaders).
//
//   kerasdist_core_tests            runs every test
//   kerasdist_core_tests --list     prints the test names
//   kerasdist_core_tests --run NAME runs one test
#ifndef KERASDIST_OPS_TESTS_HARNESS_H_
#define KERASDIST_OPS_TESTS_HARNESS_H_

#include <functional>
#include <string>
#include <vector>

#include "../core/control/control_channel.h"
#include "../core/transport/local_communicator.h"
#include "../core/transport/tcp_communicator.h"

namespace kdtest {

struct Failure {
  std::string what;
};

[[noreturn]] void Fail(const char* file, int line, const std::string& what);
void Register(const char* name, void (*fn)());

struct Registrar {
  Registrar(const char* name, void (*fn)()) { Register(name, fn); }
};

// Runs body(r) on `n` threads and rethrows the first rank's failure after
// every thread has ended.
void RunThreads(int n, const std::function<void(int)>& body);

// Polls `c` until a message comes (bounded: a lost message fails the
// test after 5 s, never hangs).
void ReceiveControl(kerasdist::core::ControlChannel& c, int* src,
                    std::string* bytes);

// Runs fn(comm) on `n` threads, rank r with a LocalCommunicator of rank r
// over one group, and rethrows the first rank's failure after every thread
// has ended. `timeout_s`: the group's barrier timeout.
void RunRanks(
    int n, const std::function<void(kerasdist::core::LocalCommunicator&)>& fn,
    double timeout_s = 5.0);

// Runs fn on a thread per rank, each with a TcpCommunicator over real
// sockets on loopback (its own listener; the mesh's key "the job's key",
// generation 7, 10 s timeouts, changed per rank by `tweak`), and fails as
// RunRanks does.
void RunTcpRanks(
    int n, const std::function<void(kerasdist::core::TcpCommunicator&)>& fn,
    const std::function<void(kerasdist::core::TcpMeshOptions&)>& tweak =
        nullptr);

// Rank 0's options of an n-rank loopback mesh and every rank's listener,
// listening (RunTcpRanks's; the tests of forming use them directly).
struct TcpJob {
  std::vector<int> listeners;
  kerasdist::core::TcpMeshOptions opt;
};
TcpJob ListenTcp(int n);

// What a rank of RunHosts is given: a communicator over every rank, one
// over its host's ranks and, on each host's first rank only, one over the
// hosts' first ranks (as the runtime makes them over MPI).
struct HostRanks {
  kerasdist::core::Communicator* comm = nullptr;
  kerasdist::core::Communicator* node = nullptr;
  kerasdist::core::Communicator* leaders = nullptr;
};

// Runs fn on a thread per rank of a job whose host h holds `hosts[h]`
// consecutive ranks; fails as RunRanks does.
void RunHosts(const std::vector<int>& hosts,
              const std::function<void(HostRanks&)>& fn,
              double timeout_s = 5.0);

// RunHosts over TCP: every rank's mesh on loopback, host h's ranks named
// "host<h>", the communicators as the runtime will make them over TCP
// (MakeNodeCommunicators).
void RunTcpHosts(const std::vector<int>& hosts,
                 const std::function<void(HostRanks&)>& fn);

}  // namespace kdtest

#define KD_TEST(name)                                        \
  static void name();                                        \
  static ::kdtest::Registrar name##_registrar(#name, &name); \
  static void name()

#define CHECK_MSG(cond, msg)                                                 \
  do {                                                                       \
    if (!(cond))                                                             \
      ::kdtest::Fail(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)
#define CHECK(cond) CHECK_MSG(cond, std::string())
#define CHECK_OK(expr)                                                       \
  do {                                                                       \
    ::kerasdist::core::Status _st = (expr);                                  \
    if (!_st.ok())                                                           \
      ::kdtest::Fail(__FILE__, __LINE__, #expr " failed: " + _st.message()); \
  } while (0)
#define CHECK_CONTAINS(text, part)                                 \
  do {                                                             \
    const std::string _t = (text), _p = (part);                    \
    if (_t.find(_p) == std::string::npos)                          \
      ::kdtest::Fail(__FILE__, __LINE__,                           \
                     "expected \"" + _p + "\" in \"" + _t + "\""); \
  } while (0)

#endif  // KERASDIST_OPS_TESTS_HARNESS_H_
