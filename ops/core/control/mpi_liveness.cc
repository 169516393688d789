// Starting the heartbeat (liveness.h) over MPI: the ranks agree on rank 0's
// settings, learn every rank's host and rank 0's addresses, and connect.
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
constexpr int kAddressBytes = 4096;

Status GatherHosts(MPI_Comm comm, int size, std::vector<std::string>* hosts) {
  char mine[kHostBytes] = {0};
  gethostname(mine, sizeof(mine) - 1);
  std::vector<char> all(static_cast<size_t>(size) * kHostBytes);
  int rc = MPI_Allgather(mine, kHostBytes, MPI_CHAR, all.data(), kHostBytes,
                         MPI_CHAR, comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Allgather");
  for (int r = 0; r < size; ++r) {
    hosts->push_back(std::string(&all[static_cast<size_t>(r) * kHostBytes]));
  }
  return Status::OK();
}

// This process's network namespace: the boot's id and the namespace's
// inode; "" when either is unknown. Two processes with the same one reach
// each other on loopback (a host name does not say that: two containers
// may share one).
std::string NetworkNamespace() {
  char boot[64] = {0};
  std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f == nullptr) return "";
  const bool read = std::fgets(boot, sizeof(boot), f) != nullptr;
  std::fclose(f);
  struct stat st;
  if (!read || stat("/proc/self/ns/net", &st) != 0) return "";
  std::string id(boot);
  id.erase(id.find_last_not_of("\n") + 1);
  return id + ":" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

// Whether this rank shares rank 0's network namespace (*mine), and whether
// every rank does (*all).
Status SameNetwork(MPI_Comm comm, int rank, bool* mine, bool* all) {
  char text[kHostBytes] = {0};
  const std::string me = NetworkNamespace();
  if (rank == 0) std::strncpy(text, me.c_str(), sizeof(text) - 1);
  int rc = MPI_Bcast(text, sizeof(text), MPI_CHAR, 0, comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Bcast");
  *mine = !me.empty() && me == text;
  int same = *mine ? 1 : 0, every = 0;
  rc = MPI_Allreduce(&same, &every, 1, MPI_INT, MPI_MIN, comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Allreduce");
  *all = every == 1;
  return Status::OK();
}

// Rank 0 listens and sends "port address address ..." to every rank (port
// -1 when it could not listen); the others read it. Rank 0 listens only
// where the ranks reach it (Liveness::ListenAddress) and then sends that
// address alone.
Status ShareEndpoint(MPI_Comm comm, int rank, const std::string& interface,
                     bool all_local, int* listen_fd, int* port,
                     std::vector<std::string>* addresses) {
  char text[kAddressBytes] = {0};
  Status listened = Status::OK();
  if (rank == 0) {
    const std::string where = Liveness::ListenAddress(all_local, interface);
    listened = Liveness::Listen(where, listen_fd, port);
    std::ostringstream s;
    s << (listened.ok() ? *port : -1);
    const std::vector<std::string> all = where.empty()
                                             ? Liveness::Addresses(interface)
                                             : std::vector<std::string>{where};
    for (const std::string& a : all) {
      if (s.str().size() + a.size() + 2 < sizeof(text)) s << ' ' << a;
    }
    std::strncpy(text, s.str().c_str(), sizeof(text) - 1);
  }
  int rc = MPI_Bcast(text, sizeof(text), MPI_CHAR, 0, comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Bcast");
  std::istringstream in(text);
  in >> *port;
  for (std::string a; in >> a;) addresses->push_back(a);
  if (!listened.ok()) return listened;
  if (*port < 0)
    return Status::Internal("rank 0 could not open its heartbeat port");
  return Status::OK();
}

// The key every heartbeat connection proves: random bytes of rank 0's,
// shared over MPI, mixed with the job's secret where there is one (so that
// who reads MPI's traffic still lacks it).
Status ShareKey(MPI_Comm comm, int rank, std::string* key) {
  char bytes[32] = {0};
  if (rank == 0) {
    const std::string random = RandomBytes(sizeof(bytes));
    if (random.size() == sizeof(bytes)) {
      std::memcpy(bytes, random.data(), sizeof(bytes));
    }
  }
  int rc = MPI_Bcast(bytes, sizeof(bytes), MPI_CHAR, 0, comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Bcast");
  const char* secret = std::getenv("KERASDIST_JOB_SECRET");
  *key = Sha256(std::string("kerasdist heartbeat|") + (secret ? secret : "") +
                "|" + std::string(bytes, sizeof(bytes)));
  return Status::OK();
}

// The pipe to this rank's wrapper (liveness.h, LivenessOptions::
// watchdog_fd): KERASDIST_WATCHDOG="<fd>:<wrapper's pid>", from kerasdist/
// run/_rank.py, for its own child only (not for a process this one starts,
// which inherits the variable). Used with recovery in place, and in a job
// of one rank, which no other rank watches: a frozen rank must die for the
// launcher to learn of it. -1 where there is none or it is not used.
int WatchdogFd(int size) {
  const char* text = std::getenv("KERASDIST_WATCHDOG");
  if (text == nullptr || (!RecoveryOn() && size > 1)) return -1;
  int fd = -1;
  long parent = -1;
  if (std::sscanf(text, "%d:%ld", &fd, &parent) != 2 || fd < 0 ||
      parent != static_cast<long>(getppid())) {
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode)) return -1;
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
  fcntl(fd, F_SETFD, fcntl(fd, F_GETFD, 0) | FD_CLOEXEC);
  return fd;
}

Status Connect(const LivenessOptions& opt, std::vector<std::string> addresses,
               bool local, int listen_fd, int port,
               std::unique_ptr<Liveness>* out) {
  if (opt.rank == 0) return Liveness::StartCoordinator(opt, listen_fd, out);
  // In rank 0's network namespace, loopback first (where rank 0 listens on
  // it): it needs no route.
  auto lo = std::find(addresses.begin(), addresses.end(), "127.0.0.1");
  if (local && lo != addresses.end())
    std::rotate(addresses.begin(), lo, lo + 1);
  return Liveness::StartWorker(opt, addresses, port, out);
}

// ---- The start-up window --------------------------------------------------

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

Status StartLiveness(MPI_Comm comm, double interval_s, double timeout_s,
                     const std::string& interface,
                     std::unique_ptr<Liveness>* out,
                     std::function<void(const std::string&)> on_lost) {
  LivenessOptions opt;
  opt.on_lost = std::move(on_lost);
  MPI_Comm_rank(comm, &opt.rank);
  MPI_Comm_size(comm, &opt.size);
  double times[2] = {interval_s, timeout_s};
  int rc = MPI_Bcast(times, 2, MPI_DOUBLE, 0, comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Bcast");
  opt.interval_s = times[0] > 0 ? times[0] : 1.0;
  opt.timeout_s = times[1];
  if (opt.timeout_s <= 0) return Status::OK();
  opt.interval_s = std::min(opt.interval_s, opt.timeout_s / 3);
  opt.watchdog_fd = WatchdogFd(opt.size);
  if (opt.size == 1) {
    // No peer: the thread only feeds the wrapper's watchdog, if any.
    if (opt.watchdog_fd < 0) return Status::OK();
    return Liveness::StartCoordinator(opt, -1, out);
  }
  KD_RETURN_IF_ERROR(GatherHosts(comm, opt.size, &opt.hosts));
  KD_RETURN_IF_ERROR(ShareKey(comm, opt.rank, &opt.key));
  bool local = false, all_local = false;
  KD_RETURN_IF_ERROR(SameNetwork(comm, opt.rank, &local, &all_local));
  int listen_fd = -1, port = -1;
  std::vector<std::string> addresses;
  Status s = ShareEndpoint(comm, opt.rank, interface, all_local, &listen_fd,
                           &port, &addresses);
  if (s.ok()) s = Connect(opt, addresses, local, listen_fd, port, out);
  int ok = s.ok() ? 1 : 0, all_ok = 0;
  rc = MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Allreduce");
  if (all_ok) return Status::OK();
  out->reset();
  if (!s.ok()) return s;
  return Status::Internal(
      "the heartbeat between the ranks could not start on another rank (its "
      "error says why)");
}

}  // namespace kerasdist::core
