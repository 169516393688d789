// kd.init()'s start-up window over MPI, before the heartbeat runs
// (start_liveness.cc starts it): the check-in and the start-up watch.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "../transport/mpi_context.h"
#include "hmac.h"

namespace kerasdist::core {
namespace {

constexpr int kHostBytes = 256;

// Tags of the check-in, on the parent communicator before kd.init() made its
// own (below MPI's guaranteed 32767, above the control tags' range).
constexpr int kCheckInTag = 32101;
constexpr int kVerdictTag = 32102;
constexpr int kVerdictBytes = 1024;
constexpr int kExitPeerLost = 75;  // as the heartbeat's (liveness.cc)
constexpr double kDefaultStartS = 300.0;

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS (the ranks' time to meet), 300 s
// where unset or malformed.
double StartDeadlineS() {
  const char* text = std::getenv("KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS");
  if (text == nullptr || *text == '\0') return kDefaultStartS;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  return (*end == '\0' && v > 0 && v < 1e9) ? v : kDefaultStartS;
}

std::string ThisHost() {
  char host[kHostBytes] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// " on host H" for a rank that never spoke, where the launcher says that
// every rank of the job runs on this host; "" where that is unknown.
std::string WhereEveryRankIs(int size) {
  for (const char* name : {"MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
    const char* text = std::getenv(name);
    if (text != nullptr && std::atoi(text) == size) {
      return " on host " + ThisHost();
    }
  }
  return "";
}

std::string RankList(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  return s.str();
}

[[noreturn]] void EndThisRank(const std::string& line) {
  std::fflush(nullptr);
  const std::string text = line + "\n";
  ssize_t ignored = write(2, text.data(), text.size());
  (void)ignored;
  _exit(kExitPeerLost);
}

// Polls `req` until it completes (true) or `deadline` passes (false),
// yielding the core between tests.
bool PollUntil(MPI_Request* req, double deadline) {
  while (true) {
    int done = 0;
    MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (done) return true;
    if (Now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

struct StartupWatch {
  std::mutex mu;
  std::condition_variable cv;
  bool armed = false;
  std::thread thread;
};

StartupWatch& Watch() {
  static StartupWatch* w = new StartupWatch();  // lives past exit handlers
  return *w;
}

}  // namespace

namespace {

// A rank other than 0: tells rank 0 its host, then waits for rank 0's
// verdict ("" when every rank arrived) until the deadline.
void WorkerCheckIn(MPI_Comm comm, int rank, double deadline,
                   const std::string& within) {
  char host[kHostBytes] = {0};
  std::strncpy(host, ThisHost().c_str(), sizeof(host) - 1);
  char verdict[kVerdictBytes] = {0};
  MPI_Request sent, heard;
  MPI_Isend(host, kHostBytes, MPI_CHAR, 0, kCheckInTag, comm, &sent);
  MPI_Irecv(verdict, kVerdictBytes, MPI_CHAR, 0, kVerdictTag, comm, &heard);
  if (!PollUntil(&heard, deadline)) {
    EndThisRank("kerasdist: rank " + std::to_string(rank) + " on host " +
                ThisHost() +
                ": lost rank 0: it did not answer kd.init()'s "
                "start " +
                within +
                " (frozen, gone, or its host unreachable, after "
                "MPI_Init); ending this rank.");
  }
  verdict[kVerdictBytes - 1] = '\0';
  if (verdict[0] != '\0') {
    EndThisRank("kerasdist: rank " + std::to_string(rank) + ": " + verdict);
  }
  MPI_Wait(&sent, MPI_STATUS_IGNORE);
}

// Rank 0: the ranks that have not checked in by the deadline.
std::vector<int> MissingAtDeadline(MPI_Comm comm, int size, double deadline) {
  std::vector<char> hosts(static_cast<size_t>(size) * kHostBytes, 0);
  std::vector<MPI_Request> reqs(size, MPI_REQUEST_NULL);
  for (int r = 1; r < size; ++r) {
    MPI_Irecv(&hosts[static_cast<size_t>(r) * kHostBytes], kHostBytes, MPI_CHAR,
              r, kCheckInTag, comm, &reqs[r]);
  }
  std::vector<int> missing;
  while (true) {
    missing.clear();
    for (int r = 1; r < size; ++r) {
      int done = 0;
      MPI_Test(&reqs[r], &done, MPI_STATUS_IGNORE);
      if (!done) missing.push_back(r);
    }
    if (missing.empty() || Now() > deadline) return missing;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Rank 0: waits for every rank until the deadline, then tells the ranks
// that arrived the verdict; ends itself (and so them) when one is missing.
void RootCheckIn(MPI_Comm comm, int size, double deadline,
                 const std::string& within) {
  const std::vector<int> missing = MissingAtDeadline(comm, size, deadline);
  std::string verdict;
  if (!missing.empty()) {
    verdict = "lost " + RankList(missing) + WhereEveryRankIs(size) +
              ": it did not reach kd.init()'s first collective " + within +
              " of rank 0's (frozen, gone, or its host unreachable, after "
              "MPI_Init); ending this rank.";
    verdict.resize(std::min<size_t>(verdict.size(), kVerdictBytes - 1));
  }
  std::vector<char> text(kVerdictBytes, 0);
  std::memcpy(text.data(), verdict.data(), verdict.size());
  std::vector<MPI_Request> sends;
  for (int r = 1; r < size; ++r) {
    if (std::find(missing.begin(), missing.end(), r) != missing.end()) continue;
    sends.emplace_back();
    MPI_Isend(text.data(), kVerdictBytes, MPI_CHAR, r, kVerdictTag, comm,
              &sends.back());
  }
  if (missing.empty()) {
    MPI_Waitall(static_cast<int>(sends.size()), sends.data(),
                MPI_STATUSES_IGNORE);
    return;
  }
  // The others hear it (a moment, not for ever: one may be gone too).
  const double told_by = Now() + 2.0;
  for (MPI_Request& s : sends) PollUntil(&s, told_by);
  EndThisRank("kerasdist: rank 0 on host " + ThisHost() + ": " + verdict);
}

}  // namespace

Status StartupCheckIn(MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (size == 1) return Status::OK();
  const double timeout_s = StartDeadlineS();
  const double deadline = Now() + timeout_s;
  std::ostringstream within;
  within << "within " << timeout_s
         << " s (KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS)";
  if (rank != 0) {
    WorkerCheckIn(comm, rank, deadline, within.str());
  } else {
    RootCheckIn(comm, size, deadline, within.str());
  }
  return Status::OK();
}

void StartStartupWatch(MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (size == 1) return;
  EndStartupWatch();
  StartupWatch& w = Watch();
  const double timeout_s = StartDeadlineS();
  std::lock_guard<std::mutex> l(w.mu);
  w.armed = true;
  w.thread = std::thread([&w, rank, timeout_s] {
    std::unique_lock<std::mutex> l(w.mu);
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration<double>(timeout_s);
    if (w.cv.wait_until(l, until, [&w] { return !w.armed; })) return;
    std::ostringstream line;
    line << "kerasdist: rank " << rank << " on host " << ThisHost()
         << ": kd.init() did not finish starting within " << timeout_s
         << " s (KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS): every rank reached "
            "its first collective, and one stopped since (frozen, gone, or "
            "its host unreachable) before the heartbeat ran; ending this "
            "rank.";
    EndThisRank(line.str());
  });
}

void EndStartupWatch() {
  StartupWatch& w = Watch();
  std::thread t;
  {
    std::lock_guard<std::mutex> l(w.mu);
    w.armed = false;
    t.swap(w.thread);
  }
  w.cv.notify_all();
  if (t.joinable()) t.join();
}

}  // namespace kerasdist::core
