#include "liveness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>

namespace kerasdist::core {
namespace {

// The exit code of a rank that ended because a peer was lost (EX_TEMPFAIL:
// the job may succeed when restarted).
constexpr int kExitPeerLost = 75;
constexpr double kConnectTimeoutS = 2.0;

enum FrameType : uint32_t {
  kHello = 1,
  kBeat = 2,
  kBye = 3,
  kLost = 4,
  kEnd = 5
};

struct Frame {
  uint32_t type;
  int32_t rank;
  uint32_t reason;
  uint32_t magic;
};
constexpr uint32_t kMagic = 0x6b646862;  // "kdhb"
static_assert(sizeof(Frame) == 16, "a frame is 16 bytes on the wire");

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool SendFrame(int fd, uint32_t type, int rank = 0, uint32_t reason = 0) {
  Frame f{type, rank, reason, kMagic};
  // Never blocks: a peer that stopped reading fills its buffer, and the
  // frames it misses do not matter (it is about to be declared lost).
  return send(fd, &f, sizeof(f), MSG_NOSIGNAL | MSG_DONTWAIT) == sizeof(f);
}

void SetNonBlocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string Errno(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

// A connect that gives up after kConnectTimeoutS; the socket or -1.
int ConnectWithTimeout(const std::string& address, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, address.c_str(), &sa.sin_addr) != 1) return -1;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  SetNonBlocking(fd);
  int rc = connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int err = ETIMEDOUT;
    socklen_t len = sizeof(err);
    if (poll(&p, 1, static_cast<int>(kConnectTimeoutS * 1000)) == 1) {
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    }
    rc = err == 0 ? 0 : -1;
  }
  if (rc != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Reads one whole frame from a fresh connection, waiting up to `timeout_s`.
bool ReadHello(int fd, double timeout_s, Frame* f) {
  size_t got = 0;
  const double until = Now() + timeout_s;
  while (got < sizeof(*f) && Now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) != 1) continue;
    ssize_t n = recv(fd, reinterpret_cast<char*>(f) + got, sizeof(*f) - got, 0);
    if (n <= 0 && !(n < 0 && errno == EAGAIN)) return false;
    if (n > 0) got += n;
  }
  return got == sizeof(*f) && f->magic == kMagic && f->type == kHello;
}

std::string ReasonText(LostReason reason, double timeout_s) {
  std::ostringstream s;
  if (reason == LostReason::kClosed) {
    s << "its connection closed without a goodbye (the process died, or "
         "its host went down)";
  } else {
    s << "no heartbeat for " << timeout_s
      << " s (the process is frozen, or its host or link is down)";
  }
  return s.str();
}

std::string RankList(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  return s.str();
}

void PrintAndExit(const std::string& line) {
  std::fflush(nullptr);
  ssize_t ignored = write(2, line.data(), line.size());
  (void)ignored;
  _exit(kExitPeerLost);
}

}  // namespace

std::string DescribeLost(const std::vector<std::string>& hosts,
                         std::vector<LostRank> lost, double timeout_s) {
  std::sort(lost.begin(), lost.end(), [](const LostRank& a, const LostRank& b) {
    return a.rank < b.rank;
  });
  // (host, reason) -> ranks, in the order of the lowest rank.
  std::vector<std::pair<std::pair<std::string, LostReason>, std::vector<int>>>
      groups;
  for (const LostRank& l : lost) {
    const std::string& host = hosts.at(l.rank);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.first.first == host && g.first.second == l.reason;
    });
    if (it == groups.end()) {
      groups.push_back({{host, l.reason}, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(l.rank);
  }
  std::ostringstream s;
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::string& host = groups[i].first.first;
    const std::vector<int>& ranks = groups[i].second;
    const size_t on_host = std::count(hosts.begin(), hosts.end(), host);
    s << (i ? "; " : "");
    if (ranks.size() == on_host) {
      s << "host " << host << " (" << RankList(ranks) << ")";
    } else {
      s << RankList(ranks) << " on host " << host;
    }
    s << ": " << ReasonText(groups[i].first.second, timeout_s);
  }
  return s.str();
}

Status Liveness::Listen(int* fd, int* port) {
  int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return Status::Internal(Errno("heartbeat socket"));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(sa);
  if (bind(s, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      listen(s, 1024) != 0 ||
      getsockname(s, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    Status st = Status::Internal(Errno("heartbeat listen"));
    close(s);
    return st;
  }
  *fd = s;
  *port = ntohs(sa.sin_port);
  return Status::OK();
}

std::vector<std::string> Liveness::Addresses(const std::string& prefer) {
  std::vector<std::pair<int, std::string>> ranked;  // (order, address)
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
      if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET ||
          !(a->ifa_flags & IFF_UP)) {
        continue;
      }
      char text[INET_ADDRSTRLEN];
      auto* in = reinterpret_cast<sockaddr_in*>(a->ifa_addr);
      if (!inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text))) continue;
      int order = a->ifa_flags & IFF_LOOPBACK ? 2 : 1;
      if (!prefer.empty() && prefer == a->ifa_name) order = 0;
      ranked.push_back({order, text});
    }
    freeifaddrs(list);
  }
  std::stable_sort(
      ranked.begin(), ranked.end(),
      [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> out;
  for (const auto& r : ranked) out.push_back(r.second);
  return out;
}

Status Liveness::StartWorker(const LivenessOptions& opt,
                             const std::vector<std::string>& addresses,
                             int port, std::unique_ptr<Liveness>* out) {
  int fd = -1;
  for (const std::string& a : addresses) {
    fd = ConnectWithTimeout(a, port);
    if (fd >= 0) break;
  }
  if (fd < 0) {
    std::ostringstream s;
    s << "rank " << opt.rank << " could not reach rank 0's heartbeat port "
      << port << " at any of its addresses (";
    for (size_t i = 0; i < addresses.size(); ++i)
      s << (i ? ", " : "") << addresses[i];
    s << "); allow TCP between the hosts, name the interface they reach "
         "each other on with --network-interface, or turn the heartbeat off "
         "with KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=0";
    return Status::Internal(s.str());
  }
  if (!SendFrame(fd, kHello, opt.rank)) {
    close(fd);
    return Status::Internal(Errno("heartbeat hello"));
  }
  std::unique_ptr<Liveness> l(new Liveness());
  l->opt_ = opt;
  l->peers_.push_back(Peer{0, fd, Now()});
  if (pipe2(l->wake_, O_CLOEXEC) != 0) return Status::Internal(Errno("pipe"));
  l->thread_ = std::thread(&Liveness::Loop, l.get());
  *out = std::move(l);
  return Status::OK();
}

Status Liveness::StartCoordinator(const LivenessOptions& opt, int listen_fd,
                                  std::unique_ptr<Liveness>* out) {
  std::unique_ptr<Liveness> l(new Liveness());
  l->opt_ = opt;
  // Each worker tries rank 0's addresses in turn, kConnectTimeoutS each.
  const double until = Now() + opt.timeout_s + 10.0;
  std::vector<bool> seen(opt.size, false);
  int missing = opt.size - 1;
  while (missing > 0 && Now() < until) {
    pollfd p{listen_fd, POLLIN, 0};
    if (poll(&p, 1, 100) != 1) continue;
    int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Frame f;
    if (!ReadHello(fd, 5.0, &f) || f.rank <= 0 || f.rank >= opt.size ||
        seen[f.rank]) {
      close(fd);
      continue;
    }
    SetNonBlocking(fd);
    seen[f.rank] = true;
    --missing;
    l->peers_.push_back(Peer{f.rank, fd, Now()});
  }
  close(listen_fd);
  if (missing > 0) {
    std::vector<int> absent;
    for (int r = 1; r < opt.size; ++r) {
      if (!seen[r]) absent.push_back(r);
    }
    return Status::Internal(RankList(absent) +
                            " never reached rank 0's heartbeat port; allow "
                            "TCP between the hosts, name the interface they "
                            "reach each other on with --network-interface, "
                            "or turn the heartbeat off with "
                            "KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=0");
  }
  if (pipe2(l->wake_, O_CLOEXEC) != 0) return Status::Internal(Errno("pipe"));
  l->thread_ = std::thread(&Liveness::Loop, l.get());
  *out = std::move(l);
  return Status::OK();
}

Liveness::~Liveness() {
  Stop();
  for (Peer& p : peers_) {
    if (p.fd >= 0) close(p.fd);
  }
  for (int fd : wake_) {
    if (fd >= 0) close(fd);
  }
}

void Liveness::Stop() {
  if (!thread_.joinable()) return;
  stop_ = true;
  char c = 0;
  ssize_t ignored = write(wake_[1], &c, 1);
  (void)ignored;
  thread_.join();
  for (Peer& p : peers_) {
    if (!p.gone) SendFrame(p.fd, kBye, opt_.rank);
    p.gone = true;
  }
}

void Liveness::Loop() {
  double next_beat = 0;
  std::vector<pollfd> fds;
  while (!stop_) {
    double now = Now();
    if (now >= next_beat) {
      Beat();
      next_beat = now + opt_.interval_s;
    }
    fds.assign(1, pollfd{wake_[0], POLLIN, 0});
    for (const Peer& p : peers_)
      fds.push_back(pollfd{p.gone ? -1 : p.fd, POLLIN, 0});
    double wait_s = next_beat - now;
    if (!lost_.empty()) wait_s = std::min(wait_s, 0.05);
    poll(fds.data(), fds.size(), std::max(0, static_cast<int>(wait_s * 1000)));
    if (fds[0].revents) break;
    now = Now();
    for (size_t i = 0; i < peers_.size(); ++i) {
      if (fds[i + 1].revents && !peers_[i].gone) Read(peers_[i], now);
    }
    CheckSilent(now);
    Settle(now);
  }
}

void Liveness::Beat() {
  for (Peer& p : peers_) {
    if (!p.gone) SendFrame(p.fd, kBeat, opt_.rank);
  }
}

void Liveness::Read(Peer& p, double now) {
  char buf[4096];
  ssize_t n = recv(p.fd, buf, sizeof(buf), MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) {  // closed, or reset
    p.gone = true;
    if (lost_.empty()) first_lost_at_ = now;
    lost_.push_back({p.rank, LostReason::kClosed});
    return;
  }
  p.inbox.append(buf, n);
  size_t used = 0;
  while (p.inbox.size() - used >= sizeof(Frame)) {
    if (!HandleFrame(p, p.inbox.data() + used, now)) break;
    used += sizeof(Frame);
  }
  p.inbox.erase(0, used);
}

bool Liveness::HandleFrame(Peer& p, const char* bytes, double now) {
  Frame f;
  std::memcpy(&f, bytes, sizeof(f));
  if (f.magic != kMagic) return false;
  p.last_heard = now;
  if (f.type == kBye) {
    p.gone = true;
    return false;
  }
  if (f.type == kLost && f.rank >= 0 && f.rank < opt_.size) {
    told_.push_back({f.rank, static_cast<LostReason>(f.reason)});
  } else if (f.type == kEnd) {
    p.gone = true;
    Report(told_);
    return false;
  }
  return true;
}

void Liveness::CheckSilent(double now) {
  for (Peer& p : peers_) {
    if (p.gone || now - p.last_heard <= opt_.timeout_s) continue;
    p.gone = true;
    if (lost_.empty()) first_lost_at_ = now;
    lost_.push_back({p.rank, LostReason::kSilent});
  }
}

// Losses come in bursts (every rank of a host at once): collect for a short
// moment after the first, so that one line names them all.
void Liveness::Settle(double now) {
  if (lost_.empty()) return;
  const double settle_s = std::min(1.0, 2 * opt_.interval_s);
  if (now - first_lost_at_ < settle_s) return;
  Report(lost_);
}

void Liveness::Report(const std::vector<LostRank>& lost) {
  if (opt_.rank == 0) {
    for (Peer& p : peers_) {
      if (p.gone) continue;
      for (const LostRank& l : lost) {
        SendFrame(p.fd, kLost, l.rank, static_cast<uint32_t>(l.reason));
      }
      SendFrame(p.fd, kEnd, opt_.rank);
    }
  }
  std::ostringstream line;
  line << "kerasdist: rank " << opt_.rank << ": lost "
       << DescribeLost(opt_.hosts, lost, opt_.timeout_s)
       << "; ending this rank.\n";
  lost_.clear();
  stop_ = true;
  (opt_.on_lost ? opt_.on_lost : PrintAndExit)(line.str());
}

}  // namespace kerasdist::core
