// kd.init()'s TCP job (tcp_job.h): the description the Python side hands
// the core, and the agreements every transport's start makes over its
// communicators (communicator.h), here over TCP ranks on threads.
#include <sched.h>

#include <string>

#include "../core/transport/tcp_job.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

const char kGood[] =
    "rank=1\nsize=2\ngeneration=3\nkey=00112233445566778899aabbccddeeff\n"
    "host=h1\ndata_fd=7\ncontrol_fd=8\n"
    "data=10.0.0.1:5000,10.0.0.2:5001\ncontrol=10.0.0.1:6000,10.0.0.2:6001\n"
    "timeout_s=12\n";

void CheckRefused(const std::string& text, const std::string& says) {
  TcpJobSpec job;
  Status s = ParseTcpJob(text, &job);
  CHECK_MSG(!s.ok() && s.message().find(says) != std::string::npos,
            "wanted an error with \"" + says + "\", got: " + s.message());
}

std::string Replace(std::string text, const std::string& line,
                    const std::string& with) {
  const size_t at = text.find(line);
  CHECK(at != std::string::npos);
  return text.replace(at, line.size(), with);
}

KD_TEST(TcpJobDescriptionParsesAndRefusesWhatIsMalformed) {
  TcpJobSpec job;
  CHECK_OK(ParseTcpJob(kGood, &job));
  const TcpContextOptions& o = job.options;
  CHECK(o.mesh.rank == 1 && o.mesh.size == 2 && o.mesh.generation == 3);
  CHECK(o.mesh.key.size() == 16 && o.mesh.key[1] == '\x11');
  CHECK(o.mesh.addresses[1] == "10.0.0.2:5001");
  CHECK(o.control_addresses[0] == "10.0.0.1:6000" && o.host == "h1");
  CHECK(job.data_fd == 7 && job.control_fd == 8);
  CHECK(o.mesh.timeout_s == 12 && o.mesh.connect_timeout_s == 30);
  CheckRefused(Replace(kGood, "host=h1\n", ""), "no host");
  CheckRefused(Replace(kGood, "rank=1", "rank=2"), "out of range");
  CheckRefused(Replace(kGood, "data_fd=7", "data_fd=x"), "out of range");
  CheckRefused(Replace(kGood, "key=0011", "key=zz11"), "hex");
  CheckRefused(Replace(kGood, ",10.0.0.2:5001", ""), "one address for each");
  CheckRefused(Replace(kGood, "timeout_s=12", "timeout_s=0"), "timeout_s");
  CheckRefused(Replace(kGood, "size=2", "size"), "no '='");
  // A refused description leaves none pending.
  CHECK(!SetTcpJob("rank=0\n").ok() && !TcpJobPending());
}

KD_TEST(AgreeStartedNamesTheFirstRankWhoseStartFailed) {
  RunTcpRanks(3, [](TcpCommunicator& comm) {
    const int r = comm.rank();
    const Status mine =
        r == 0 ? Status::OK() : Status::Internal("mine " + std::to_string(r));
    Status s = AgreeStarted(comm, mine);
    if (r == 0) {
      CHECK_MSG(s.message().find("rank 1's start failed") == 0, s.message());
    } else {
      CHECK(s.message() == "mine " + std::to_string(r));
    }
    CHECK_OK(AgreeStarted(comm, Status::OK()));
  });
}

KD_TEST(NodeOversubscribedCountsTheRanksAgainstTheirCpus) {
  cpu_set_t all;
  CPU_ZERO(&all);
  CHECK(sched_getaffinity(0, sizeof(all), &all) == 0);
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  // Two ranks on every CPU this process may use, then both on one (an
  // affinity mask is a thread's: each rank pins its own).
  for (bool pinned : {false, true}) {
    RunTcpRanks(2, [&](TcpCommunicator& comm) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(first, &one);
      CHECK(sched_setaffinity(0, sizeof(cpu_set_t), pinned ? &one : &all) == 0);
      bool over = !pinned;
      CHECK_OK(NodeOversubscribed(comm, &over));
      CHECK_MSG(over == (pinned || CPU_COUNT(&all) < 2),
                pinned ? "pinned" : "unpinned");
    });
  }
}

}  // namespace
}  // namespace kdtest
