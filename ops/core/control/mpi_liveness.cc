// Starting the heartbeat (liveness.h) over MPI: the ranks agree on rank 0's
// settings, learn every rank's host and rank 0's addresses, and connect.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

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

Status StartLiveness(MPI_Comm comm, double interval_s, double timeout_s,
                     const std::string& interface,
                     std::unique_ptr<Liveness>* out) {
  LivenessOptions opt;
  MPI_Comm_rank(comm, &opt.rank);
  MPI_Comm_size(comm, &opt.size);
  double times[2] = {interval_s, timeout_s};
  int rc = MPI_Bcast(times, 2, MPI_DOUBLE, 0, comm);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Bcast");
  opt.interval_s = times[0] > 0 ? times[0] : 1.0;
  opt.timeout_s = times[1];
  if (opt.size == 1 || opt.timeout_s <= 0) return Status::OK();
  opt.interval_s = std::min(opt.interval_s, opt.timeout_s / 3);
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
