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
#include <mutex>
#include <sstream>

#include "../transport/sockets.h"
#include "hmac.h"

namespace kerasdist::core {
namespace {

// LastLostRanks: the heartbeat's last report in this process.
std::mutex g_lost_mu;
std::vector<int> g_last_lost;

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

double Now() { return MonotonicSeconds(); }

bool SendFrame(int fd, uint32_t type, int rank = 0, uint32_t reason = 0) {
  Frame f{type, rank, reason, kMagic};
  // Never blocks: a peer that stopped reading fills its buffer, and the
  // frames it misses do not matter (it is about to be declared lost).
  return send(fd, &f, sizeof(f), MSG_NOSIGNAL | MSG_DONTWAIT) == sizeof(f);
}

// A connect that gives up after kConnectTimeoutS; the socket or -1.
int ConnectWithTimeout(const std::string& address, int port) {
  return core::ConnectWithTimeout(address, port, kConnectTimeoutS);
}

constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;

// What each side proves: the HMAC of both nonces and the rank, under the
// job's key, with a label so that one side's proof is never the other's.
std::string Proof(const std::string& key, const char* label,
                  const std::string& first, const std::string& second,
                  int rank) {
  return HmacSha256(key,
                    std::string(label) + first + second + std::to_string(rank));
}

bool SendAll(int fd, const std::string& data) {
  return core::SendAll(fd, data, kConnectTimeoutS);
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

Status Liveness::Listen(const std::string& address, int* fd, int* port) {
  return ListenTcp(address, "heartbeat listen", fd, port);
}

std::string Liveness::InterfaceAddress(const std::string& name) {
  std::string out;
  ifaddrs* list = nullptr;
  if (name.empty() || getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET ||
        name != a->ifa_name) {
      continue;
    }
    char text[INET_ADDRSTRLEN];
    auto* in = reinterpret_cast<sockaddr_in*>(a->ifa_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text))) {
      out = text;
      break;
    }
  }
  freeifaddrs(list);
  return out;
}

std::string Liveness::ListenAddress(bool all_local,
                                    const std::string& interface) {
  if (all_local) return "127.0.0.1";
  return InterfaceAddress(interface);
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
  Status proved = Handshake(fd, opt, opt.timeout_s + 10.0);
  if (!proved.ok()) {
    close(fd);
    return proved;
  }
  std::unique_ptr<Liveness> l(new Liveness());
  l->opt_ = opt;
  l->peers_.push_back(Peer{0, fd, Now()});
  if (pipe2(l->wake_, O_CLOEXEC) != 0)
    return Status::Internal(ErrnoText("pipe"));
  l->thread_ = std::thread(&Liveness::Loop, l.get());
  *out = std::move(l);
  return Status::OK();
}

Status Liveness::Handshake(int fd, const LivenessOptions& opt,
                           double timeout_s) {
  const std::string mine = RandomBytes(kNonceBytes);
  if (mine.empty()) return Status::Internal(ErrnoText("getrandom"));
  Frame f{kHello, opt.rank, 0, kMagic};
  std::string hello(reinterpret_cast<const char*>(&f), sizeof(f));
  if (!SendAll(fd, hello + mine)) {
    return Status::Internal(ErrnoText("heartbeat hello"));
  }
  std::string answer;
  if (!ReadExactly(fd, kNonceBytes + kMacBytes, timeout_s, &answer)) {
    return Status::Internal(
        "rank " + std::to_string(opt.rank) +
        ": rank 0's heartbeat port did not answer the hello within " +
        std::to_string(static_cast<int>(timeout_s)) +
        " s; check that every rank of the job has the same "
        "KERASDIST_JOB_SECRET");
  }
  const std::string theirs = answer.substr(0, kNonceBytes);
  if (!EqualInConstantTime(
          answer.substr(kNonceBytes),
          Proof(opt.key, "kdhb rank 0", mine, theirs, opt.rank))) {
    return Status::Internal(
        "rank " + std::to_string(opt.rank) +
        ": the process on rank 0's heartbeat port did not prove the job's "
        "key (another job's, or not kerasdist's); check that every rank of "
        "the job has the same KERASDIST_JOB_SECRET");
  }
  if (!SendAll(fd, Proof(opt.key, "kdhb worker", theirs, mine, opt.rank))) {
    return Status::Internal(ErrnoText("heartbeat proof"));
  }
  return Status::OK();
}

namespace {

// A connection to rank 0's port that has not proved the key yet.
struct Pending {
  int fd = -1;
  double since = 0;
  std::string inbox;   // bytes of its current step
  int rank = -1;       // once its hello came
  std::string nonce;   // rank 0's, once sent
  std::string theirs;  // the worker's
};

// Rank 0's side of the workers' handshakes, side by side: each worker
// sends a hello and its nonce, rank 0 answers with its nonce and proof,
// the worker proves the key. Connections that stall past Liveness::kHandshakeS,
// send garbage or fail the proof are dropped; at most Liveness::kMaxPending
// wait.
class Handshakes {
 public:
  explicit Handshakes(const LivenessOptions& opt)
      : opt_(opt), seen_(opt.size, false), missing_(opt.size - 1) {}
  ~Handshakes() {
    for (Pending& p : pending_) close(p.fd);
  }

  int missing() const { return missing_; }
  int unproven() const { return unproven_; }
  bool seen(int rank) const { return seen_[rank]; }

  // Waits up to 100 ms, then steps the ready handshakes and accepts a new
  // connection; appends the workers that proved the key to `proven`
  // (rank, fd).
  void Poll(int listen_fd, std::vector<std::pair<int, int>>* proven) {
    std::vector<pollfd> fds{{listen_fd, POLLIN, 0}};
    for (const Pending& p : pending_) fds.push_back({p.fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), 100) <= 0) return;
    const double now = Now();
    // From the last, as they may go.
    for (size_t i = pending_.size(); i-- > 0;) {
      if (!fds[i + 1].revents) {
        if (now - pending_[i].since > Liveness::kHandshakeS) Drop(i);
        continue;
      }
      Step(i, now, proven);
    }
    if (fds[0].revents) Accept(listen_fd, now);
  }

 private:
  void Drop(size_t i) {
    close(pending_[i].fd);
    pending_.erase(pending_.begin() + i);
  }

  void Step(size_t i, double now, std::vector<std::pair<int, int>>* proven) {
    Pending& p = pending_[i];
    const size_t want =
        p.nonce.empty() ? sizeof(Frame) + kNonceBytes : kMacBytes;
    char buf[64];
    ssize_t n = recv(p.fd, buf, want - p.inbox.size(), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
      Drop(i);
      return;
    }
    if (n > 0) p.inbox.append(buf, n);
    if (p.inbox.size() < want) {
      if (now - p.since > Liveness::kHandshakeS) Drop(i);
      return;
    }
    if (p.nonce.empty()) {
      if (!Answer(p)) Drop(i);
      return;
    }
    if (!EqualInConstantTime(p.inbox, Proof(opt_.key, "kdhb worker", p.nonce,
                                            p.theirs, p.rank)) ||
        seen_[p.rank]) {
      ++unproven_;
      Drop(i);
      return;
    }
    seen_[p.rank] = true;
    --missing_;
    proven->emplace_back(p.rank, p.fd);
    pending_.erase(pending_.begin() + i);
  }

  // The hello and the worker's nonce are in: rank 0's nonce and proof.
  bool Answer(Pending& p) {
    Frame f;
    std::memcpy(&f, p.inbox.data(), sizeof(f));
    if (f.magic != kMagic || f.type != kHello || f.rank <= 0 ||
        f.rank >= opt_.size || seen_[f.rank]) {
      return false;
    }
    p.rank = f.rank;
    p.theirs = p.inbox.substr(sizeof(f));
    p.nonce = RandomBytes(kNonceBytes);
    p.inbox.clear();
    return !p.nonce.empty() &&
           SendAll(p.fd, p.nonce + Proof(opt_.key, "kdhb rank 0", p.theirs,
                                         p.nonce, p.rank));
  }

  void Accept(int listen_fd, double now) {
    int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      SetNonBlocking(fd);
      if (pending_.size() >= static_cast<size_t>(Liveness::kMaxPending))
        Drop(0);
      pending_.push_back(Pending{fd, now});
    } else if (errno == EMFILE || errno == ENFILE) {
      // Out of descriptors: the oldest handshakes make room.
      for (int k = 0; k < Liveness::kMaxPending / 2 && !pending_.empty(); ++k)
        Drop(0);
    }
  }

  const LivenessOptions& opt_;
  std::vector<bool> seen_;
  int missing_;
  int unproven_ = 0;  // handshakes that failed their proof
  std::vector<Pending> pending_;
};

// The error of a coordinator whose workers did not all arrive in time.
Status MissingWorkers(const Handshakes& hs, int size) {
  std::vector<int> absent;
  for (int r = 1; r < size; ++r) {
    if (!hs.seen(r)) absent.push_back(r);
  }
  std::string why =
      " never reached rank 0's heartbeat port; allow TCP between the "
      "hosts, name the interface they reach each other on with "
      "--network-interface, or turn the heartbeat off with "
      "KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=0";
  if (hs.unproven() > 0) {
    why += " (" + std::to_string(hs.unproven()) +
           " connection(s) did not prove the job's key: check that every "
           "rank has the same KERASDIST_JOB_SECRET)";
  }
  return Status::Internal(RankList(absent) + why);
}

}  // namespace

Status Liveness::StartCoordinator(const LivenessOptions& opt, int listen_fd,
                                  std::unique_ptr<Liveness>* out) {
  std::unique_ptr<Liveness> l(new Liveness());
  l->opt_ = opt;
  // Each worker tries rank 0's addresses in turn, kConnectTimeoutS each.
  const double until = Now() + opt.timeout_s + 10.0;
  Handshakes hs(l->opt_);
  std::vector<std::pair<int, int>> proven;
  while (hs.missing() > 0 && Now() < until) hs.Poll(listen_fd, &proven);
  if (listen_fd >= 0) close(listen_fd);
  for (const auto& [rank, fd] : proven) {
    l->peers_.push_back(Peer{rank, fd, Now()});
  }
  if (hs.missing() > 0) {
    for (Peer& p : l->peers_) close(p.fd);
    l->peers_.clear();
    return MissingWorkers(hs, opt.size);
  }
  if (pipe2(l->wake_, O_CLOEXEC) != 0)
    return Status::Internal(ErrnoText("pipe"));
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
  {
    std::lock_guard<std::mutex> l(g_lost_mu);
    g_last_lost.clear();
  }
  double next_beat = 0;
  std::vector<pollfd> fds;
  Feed(("arm " + std::to_string(opt_.timeout_s) + "\n").c_str());
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
  Feed("off\n");
}

void Liveness::Beat() {
  for (Peer& p : peers_) {
    if (!p.gone) SendFrame(p.fd, kBeat, opt_.rank);
  }
  Feed("beat\n");
}

// One write each, never blocking (a pipe write under PIPE_BUF is whole).
void Liveness::Feed(const char* text) const {
  if (opt_.watchdog_fd < 0) return;
  ssize_t ignored = write(opt_.watchdog_fd, text, std::strlen(text));
  (void)ignored;
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
  const double settle_s =
      opt_.settle_s >= 0 ? opt_.settle_s : std::min(1.0, 2 * opt_.interval_s);
  if (now - first_lost_at_ < settle_s) return;
  Report(lost_);
}

std::vector<int> LastLostRanks() {
  std::lock_guard<std::mutex> l(g_lost_mu);
  return g_last_lost;
}

void Liveness::Report(const std::vector<LostRank>& lost) {
  {
    std::lock_guard<std::mutex> l(g_lost_mu);
    g_last_lost.clear();
    for (const LostRank& r : lost) g_last_lost.push_back(r.rank);
  }
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
