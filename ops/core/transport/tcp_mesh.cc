#include "tcp_mesh.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <thread>

#include "../control/hmac.h"
#include "sockets.h"

namespace kerasdist::core {
namespace {

constexpr char kMagic[4] = {'k', 'd', 't', 'm'};
constexpr uint32_t kVersion = 1;
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kHelloBytes = 4 + 4 + 4 + 8 + 4 + 4 + kNonceBytes;

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

template <typename T>
T Get(const std::string& in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(v));
  return v;
}

// magic, version, channel, generation, from, to, nonce.
std::string Hello(const TcpMeshOptions& opt, int to, const std::string& nonce) {
  std::string h(kMagic, sizeof(kMagic));
  Put(&h, kVersion);
  Put<uint32_t>(&h, opt.channel);
  Put(&h, opt.generation);
  Put<int32_t>(&h, opt.rank);
  Put<int32_t>(&h, to);
  return h + nonce;
}

// Each side's proof: the HMAC of the hello and the listener's nonce under
// the job's key, with a label so that one side's is never the other's.
std::string Proof(const std::string& key, const char* label,
                  const std::string& hello, const std::string& nonce) {
  return HmacSha256(key, std::string(label) + hello + nonce);
}

std::string Rank(int r) { return "rank " + std::to_string(r); }

// One connection the listener accepted, its handshake not done yet.
struct Pending {
  int fd = -1;
  double deadline = 0;
  std::string in;     // bytes read so far of what is awaited
  std::string hello;  // the dialer's, once checked
  std::string nonce;  // the listener's
  int from = -1;
};

// Why a hello is refused, or "" when it is one this rank awaits.
std::string CheckHello(const std::string& h, const TcpMeshOptions& opt,
                       const std::vector<int>& fds) {
  if (std::memcmp(h.data(), kMagic, sizeof(kMagic)) != 0 ||
      Get<uint32_t>(h, 4) != kVersion) {
    return "not a kerasdist mesh hello";
  }
  const uint32_t channel = Get<uint32_t>(h, 8);
  const uint64_t generation = Get<uint64_t>(h, 12);
  const int from = Get<int32_t>(h, 20), to = Get<int32_t>(h, 24);
  if (channel != opt.channel) {
    return "a hello for channel " + std::to_string(channel) +
           ", this listener's is " + std::to_string(opt.channel);
  }
  if (generation != opt.generation) {
    return "a hello of generation " + std::to_string(generation) +
           ", this mesh's is " + std::to_string(opt.generation);
  }
  if (to != opt.rank || from <= opt.rank || from >= opt.size) {
    return "a hello from " + Rank(from) + " to " + Rank(to) +
           ", which this rank does not await";
  }
  if (fds[from] >= 0) return Rank(from) + " is connected already";
  return "";
}

// Moves one pending handshake along with what arrived; false when it is
// over (done: *proven is the dialer's rank; else refused, `why` says why).
bool Advance(Pending& p, const TcpMeshOptions& opt, const std::vector<int>& fds,
             int* proven, std::string* why) {
  const size_t want = p.hello.empty() ? kHelloBytes : kMacBytes;
  char buf[kHelloBytes];
  ssize_t n = recv(p.fd, buf, want - p.in.size(), 0);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
    *why = "the connection closed during its handshake";
    return false;
  }
  if (n > 0) p.in.append(buf, n);
  if (p.in.size() < want) return true;
  if (p.hello.empty()) {
    *why = CheckHello(p.in, opt, fds);
    p.nonce = RandomBytes(kNonceBytes);
    if (why->empty() && p.nonce.empty()) *why = ErrnoText("getrandom");
    if (!why->empty()) return false;
    p.hello.swap(p.in);
    p.in.clear();
    p.from = Get<int32_t>(p.hello, 20);
    if (!SendAll(p.fd,
                 p.nonce + Proof(opt.key, "kdtm-listener", p.hello, p.nonce),
                 TcpMesh::kHandshakeS)) {
      *why = "could not answer its hello";
      return false;
    }
    return true;
  }
  if (!EqualInConstantTime(p.in,
                           Proof(opt.key, "kdtm-dialer", p.hello, p.nonce))) {
    *why = "it did not prove the job's key (another job on this port?)";
    return false;
  }
  *proven = p.from;
  return false;
}

}  // namespace

bool SplitHostPort(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  const std::string digits = address.substr(colon + 1);
  if (digits.empty() || digits.size() > 5 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  *port = std::stoi(digits);
  *host = address.substr(0, colon);
  return *port > 0 && *port < 65536;
}

TcpMesh::TcpMesh(const TcpMeshOptions& opt) : opt_(opt), fds_(opt.size, -1) {}

TcpMesh::~TcpMesh() {
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
}

Status TcpMesh::Listen(const std::string& address, int* fd, int* port) {
  return ListenTcp(address, "mesh listen", fd, port);
}

Status TcpMesh::Form(const TcpMeshOptions& opt, int listen_fd,
                     std::unique_ptr<TcpMesh>* out) {
  if (opt.size < 1 || opt.rank < 0 || opt.rank >= opt.size ||
      static_cast<int>(opt.addresses.size()) != opt.size) {
    return Status::InvalidArgument(
        "mesh: " + Rank(opt.rank) + " of " + std::to_string(opt.size) +
        " with " + std::to_string(opt.addresses.size()) + " addresses");
  }
  std::unique_ptr<TcpMesh> mesh(new TcpMesh(opt));
  const double deadline = MonotonicSeconds() + opt.connect_timeout_s;
  for (int peer = 0; peer < opt.rank; ++peer) {
    KD_RETURN_IF_ERROR(mesh->Dial(peer, deadline));
  }
  KD_RETURN_IF_ERROR(mesh->AcceptHigher(listen_fd, deadline));
  *out = std::move(mesh);
  return Status::OK();
}

Status TcpMesh::Dial(int peer, double deadline) {
  const std::string& address = opt_.addresses[peer];
  std::string host;
  int port = 0;
  if (!SplitHostPort(address, &host, &port)) {
    return Status::InvalidArgument("mesh: " + Rank(peer) + "'s address '" +
                                   address + "' is not host:port");
  }
  const std::string nonce = RandomBytes(kNonceBytes);
  if (nonce.empty()) return Status::Internal(ErrnoText("getrandom"));
  const std::string hello = Hello(opt_, peer, nonce);
  std::string why = "it did not answer";
  while (MonotonicSeconds() < deadline) {
    int fd = ConnectWithTimeout(host, port, 1.0);
    if (fd < 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    std::string answer;
    if (SendAll(fd, hello, kHandshakeS) &&
        ReadExactly(fd, kNonceBytes + kMacBytes, deadline - MonotonicSeconds(),
                    &answer)) {
      const std::string theirs = answer.substr(0, kNonceBytes);
      if (!EqualInConstantTime(
              answer.substr(kNonceBytes),
              Proof(opt_.key, "kdtm-listener", hello, theirs))) {
        close(fd);
        return Status::Aborted("mesh: " + Rank(peer) + " at " + address +
                               " did not prove the job's key (another "
                               "job on its port?)");
      }
      if (SendAll(fd, Proof(opt_.key, "kdtm-dialer", hello, theirs),
                  kHandshakeS)) {
        fds_[peer] = fd;
        return Status::OK();
      }
    }
    why =
        "it closed the connection during the handshake (not a rank of "
        "this mesh's generation?)";
    close(fd);
    break;
  }
  return Status::RanksLost("mesh: " + Rank(opt_.rank) +
                           " could not connect to " + Rank(peer) + " at " +
                           address + ": " + why + ".");
}

Status TcpMesh::AcceptHigher(int listen_fd, double deadline) {
  std::deque<Pending> pending;
  int missing = opt_.size - 1 - opt_.rank;
  std::string refused;
  while (missing > 0 && MonotonicSeconds() < deadline) {
    std::vector<pollfd> polls{{listen_fd, POLLIN, 0}};
    for (const Pending& p : pending) polls.push_back({p.fd, POLLIN, 0});
    poll(polls.data(), polls.size(), 100);
    const double now = MonotonicSeconds();
    if (polls[0].revents & POLLIN) {
      int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        SetNonBlocking(fd);
        pending.push_back(Pending{fd, now + kHandshakeS});
        if (pending.size() > kMaxPending) {
          close(pending.front().fd);
          pending.pop_front();
        }
      }
    }
    for (auto it = pending.begin(); it != pending.end();) {
      int proven = -1;
      std::string why;
      bool going =
          now < it->deadline && Advance(*it, opt_, fds_, &proven, &why);
      if (going) {
        ++it;
        continue;
      }
      if (proven >= 0) {
        fds_[proven] = it->fd;
        --missing;
      } else {
        close(it->fd);
        refused = why.empty() ? "a handshake took over 5 s" : why;
      }
      it = pending.erase(it);
    }
  }
  for (const Pending& p : pending) close(p.fd);
  if (missing == 0) return Status::OK();
  std::string ranks;
  for (int r = opt_.rank + 1; r < opt_.size; ++r) {
    if (fds_[r] < 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  ranks = (missing == 1 ? "rank " : "ranks ") + ranks;
  return Status::RanksLost(
      "mesh: " + Rank(opt_.rank) + ": " + ranks + " did not connect " +
      "within " + std::to_string(static_cast<int>(opt_.connect_timeout_s)) +
      " s" + (refused.empty() ? "" : " (last refused: " + refused + ")") + ".");
}

void TcpMesh::Abort(const std::string& why) {
  if (broken_.ok()) broken_ = Status::Aborted(why);
  for (int& fd : fds_) {
    if (fd >= 0) {
      shutdown(fd, SHUT_RDWR);
      close(fd);
      fd = -1;
    }
  }
}

void TcpMesh::Revoke(const std::string& why) {
  if (revoked_.load()) return;
  revoked_why_ = why;
  revoked_.store(true);
  for (int fd : fds_) {
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
  }
}

Status TcpMesh::Fail(Status s) {
  if (revoked_.load()) {
    s = Status::RanksLost("mesh: rank " + std::to_string(opt_.rank) +
                          ": revoked: " + revoked_why_);
  }
  if (broken_.ok()) broken_ = s;
  for (int fd : fds_) {
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
  }
  return s;
}

// One Exchange in progress: a header and a payload each way.
struct TcpMesh::Transfer {
  static constexpr int64_t kHeader = 32;
  struct Header {
    char magic[4] = {'k', 'd', 't', 'x'};
    uint32_t reserved = 0;
    int64_t bytes = 0;
    char what[16] = {};
  };
  static_assert(sizeof(Header) == kHeader, "a header is 32 bytes");
  const char* what;
  int dest;
  const char* send;
  Header send_header;
  int64_t sent = 0;  // of the header and the payload
  int source;
  char* recv;
  int64_t recv_bytes;
  Header recv_header;
  int64_t got = 0;

  int64_t send_total() const {
    return dest < 0 ? 0 : kHeader + send_header.bytes;
  }
  int64_t recv_total() const { return source < 0 ? 0 : kHeader + recv_bytes; }
};

namespace {

std::string HeaderWhat(const char (&what)[16]) {
  return std::string(what, strnlen(what, sizeof(what)));
}

}  // namespace

Status TcpMesh::Lost(const Transfer& t, int peer, const char* verb) {
  std::string m =
      "mesh: " + Rank(opt_.rank) + ": " + t.what + ": " + Rank(peer);
  if (*verb == '\0') {
    m += " closed its connection (its process ended, its host went down, or "
         "it left the mesh after losing a peer).";
  } else {
    m += std::string(" ") + verb + " nothing for " +
         std::to_string(static_cast<int>(opt_.timeout_s)) +
         " s (the process is frozen, or its host or link is down).";
  }
  return Fail(Status::RanksLost(m));
}

Status TcpMesh::CheckHeader(const Transfer& t) {
  const Transfer::Header& h = t.recv_header;
  const std::string theirs = HeaderWhat(h.what);
  if (std::memcmp(h.magic, "kdtx", 4) == 0 && theirs == t.what &&
      h.bytes == t.recv_bytes) {
    return Status::OK();
  }
  return Fail(Status::Mismatch(
      "mesh: " + Rank(opt_.rank) + ": " + t.what + ": expected " +
      std::to_string(t.recv_bytes) + " bytes of " + t.what + " from " +
      Rank(t.source) + ", which sent " + std::to_string(h.bytes) +
      " bytes of " + theirs +
      " (the ranks ran different collectives, or sizes)."));
}

Status TcpMesh::Exchange(const char* what, int dest, const void* send,
                         int64_t send_bytes, int source, void* recv,
                         int64_t recv_bytes) {
  KD_RETURN_IF_ERROR(broken_);
  if (revoked_.load()) return Fail(Status::OK());
  if (dest == opt_.rank || source == opt_.rank || dest >= opt_.size ||
      source >= opt_.size) {
    return Status::Internal(std::string("mesh: ") + what + ": " +
                            Rank(opt_.rank) + " exchanging with rank " +
                            std::to_string(dest) + " / " +
                            std::to_string(source) + " (kerasdist bug).");
  }
  Transfer t{what, dest,   static_cast<const char*>(send), {},
             0,    source, static_cast<char*>(recv),       recv_bytes,
             {},   0};
  t.send_header.bytes = send_bytes;
  std::memcpy(t.send_header.what, what,
              strnlen(what, sizeof(t.send_header.what)));
  return Run(t);
}

namespace {

// One non-blocking sendmsg (or recvmsg) of what is left of a header and
// its payload, together: 1 when bytes moved, 0 when none could, -1 when
// the connection is gone.
int MoveSome(bool out, int fd, char* header, int64_t header_bytes,
             char* payload, int64_t payload_bytes, int64_t* done) {
  iovec parts[2];
  int count = 0;
  if (*done < header_bytes) {
    parts[count++] = {header + *done,
                      static_cast<size_t>(header_bytes - *done)};
  }
  const int64_t into = std::max<int64_t>(0, *done - header_bytes);
  if (payload_bytes > into) {
    parts[count++] = {payload + into,
                      static_cast<size_t>(payload_bytes - into)};
  }
  msghdr m{};
  m.msg_iov = parts;
  m.msg_iovlen = count;
  ssize_t r = out ? sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT)
                  : recvmsg(fd, &m, MSG_DONTWAIT);
  if (r > 0) {
    *done += r;
    return 1;
  }
  if (r < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
  return out && r == 0 ? 0 : -1;
}

}  // namespace

// Sends and receives whatever the sockets take, polling only when neither
// moved; a header is checked as soon as it is whole.
Status TcpMesh::Run(Transfer& t) {
  constexpr int64_t kH = Transfer::kHeader;
  double last = MonotonicSeconds();
  bool checked = t.source < 0;
  while (t.sent < t.send_total() || t.got < t.recv_total()) {
    const bool sending = t.sent < t.send_total();
    const bool receiving = t.got < t.recv_total();
    int sent = 0, got = 0;
    if (sending) {
      sent =
          MoveSome(true, fds_[t.dest], reinterpret_cast<char*>(&t.send_header),
                   kH, const_cast<char*>(t.send), t.send_header.bytes, &t.sent);
      if (sent < 0) return Lost(t, t.dest, "");
    }
    if (receiving) {
      got = MoveSome(false, fds_[t.source],
                     reinterpret_cast<char*>(&t.recv_header), kH, t.recv,
                     t.recv_bytes, &t.got);
      if (got < 0) return Lost(t, t.source, "");
    }
    if (!checked && t.got >= kH) {
      checked = true;
      KD_RETURN_IF_ERROR(CheckHeader(t));
    }
    const double now = MonotonicSeconds();
    if (sent > 0 || got > 0) {
      last = now;
      continue;
    }
    if (now - last > opt_.timeout_s) {
      return Lost(t, receiving ? t.source : t.dest,
                  receiving ? "sent" : "took");
    }
    pollfd polls[2] = {{sending ? fds_[t.dest] : -1, POLLOUT, 0},
                       {receiving ? fds_[t.source] : -1, POLLIN, 0}};
    poll(polls, 2, 100);
  }
  return Status::OK();
}

}  // namespace kerasdist::core
