// Starting the heartbeat (liveness.h) over a job's transport (MPI or TCP):
// the ranks agree on rank 0's settings, learn every rank's host and rank
// 0's addresses, and connect.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "hmac.h"
#include "liveness.h"

namespace kerasdist::core {
namespace {

constexpr int kHostBytes = 256;
constexpr int kAddressBytes = 4096;

Status GatherHosts(Communicator& comm, int size,
                   std::vector<std::string>* hosts) {
  char mine[kHostBytes] = {0};
  gethostname(mine, sizeof(mine) - 1);
  std::vector<char> all(static_cast<size_t>(size) * kHostBytes);
  KD_RETURN_IF_ERROR(comm.Allgather(mine, all.data(), kHostBytes));
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
Status SameNetwork(Communicator& comm, int rank, bool* mine, bool* all) {
  char text[kHostBytes] = {0};
  const std::string me = NetworkNamespace();
  if (rank == 0) std::strncpy(text, me.c_str(), sizeof(text) - 1);
  KD_RETURN_IF_ERROR(comm.Broadcast(text, sizeof(text), 0));
  *mine = !me.empty() && me == text;
  return AgreeAll(comm, *mine, all);
}

// Rank 0 listens and sends "port address address ..." to every rank (port
// -1 when it could not listen); the others read it. Rank 0 listens only
// where the ranks reach it (Liveness::ListenAddress) and then sends that
// address alone.
Status ShareEndpoint(Communicator& comm, int rank, const std::string& interface,
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
  KD_RETURN_IF_ERROR(comm.Broadcast(text, sizeof(text), 0));
  std::istringstream in(text);
  in >> *port;
  for (std::string a; in >> a;) addresses->push_back(a);
  if (!listened.ok()) return listened;
  if (*port < 0)
    return Status::Internal("rank 0 could not open its heartbeat port");
  return Status::OK();
}

// The key every heartbeat connection proves: random bytes of rank 0's,
// shared over the transport, mixed with the job's secret where there is one
// (so that who reads the transport's traffic still lacks it).
Status ShareKey(Communicator& comm, int rank, std::string* key) {
  char bytes[32] = {0};
  if (rank == 0) {
    const std::string random = RandomBytes(sizeof(bytes));
    if (random.size() == sizeof(bytes)) {
      std::memcpy(bytes, random.data(), sizeof(bytes));
    }
  }
  KD_RETURN_IF_ERROR(comm.Broadcast(bytes, sizeof(bytes), 0));
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
int WatchdogFd(int size, bool recovery) {
  const char* text = std::getenv("KERASDIST_WATCHDOG");
  if (text == nullptr || (!recovery && size > 1)) return -1;
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

}  // namespace

Status StartLiveness(Communicator& comm, const LivenessStart& start,
                     std::unique_ptr<Liveness>* out) {
  LivenessOptions opt;
  opt.on_lost = start.on_lost;
  opt.settle_s = start.settle_s;
  opt.rank = comm.rank();
  opt.size = comm.size();
  double times[2] = {start.interval_s, start.timeout_s};
  KD_RETURN_IF_ERROR(comm.Broadcast(times, sizeof(times), 0));
  opt.interval_s = times[0] > 0 ? times[0] : 1.0;
  opt.timeout_s = times[1];
  if (opt.timeout_s <= 0) return Status::OK();
  opt.interval_s = std::min(opt.interval_s, opt.timeout_s / 3);
  opt.watchdog_fd = WatchdogFd(opt.size, start.recovery);
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
  Status s = ShareEndpoint(comm, opt.rank, start.interface, all_local,
                           &listen_fd, &port, &addresses);
  if (s.ok()) s = Connect(opt, addresses, local, listen_fd, port, out);
  bool all_ok = false;
  KD_RETURN_IF_ERROR(AgreeAll(comm, s.ok(), &all_ok));
  if (all_ok) return Status::OK();
  out->reset();
  if (!s.ok()) return s;
  return Status::Internal(
      "the heartbeat between the ranks could not start on another rank (its "
      "error says why)");
}

}  // namespace kerasdist::core
