#include "tcp_control.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstring>

#include "sockets.h"

namespace kerasdist::core {
namespace {

constexpr char kMagic[4] = {'k', 'd', 't', 'c'};
constexpr size_t kFrameHeader = 8;

}  // namespace

TcpControl::TcpControl(std::unique_ptr<TcpMesh> mesh)
    : mesh_(std::move(mesh)), peers_(mesh_->size()) {}

Status TcpControl::Broken(int peer, const std::string& why) {
  const std::string me = "control: rank " + std::to_string(mesh_->rank());
  if (broken_.ok() && mesh_->revoked()) {
    broken_ = Status::RanksLost(me + ": revoked: " + mesh_->revoked_why());
  } else if (broken_.ok()) {
    broken_ = Status::RanksLost(me + ": rank " + std::to_string(peer) + " " +
                                why + ".");
  }
  return broken_;
}

Status TcpControl::SendControl(int dest, std::string bytes) {
  KD_RETURN_IF_ERROR(broken_);
  if (dest < 0 || dest >= mesh_->size() || dest == mesh_->rank() ||
      bytes.size() > kMaxFrame) {
    return Status::Internal("control: a message of " +
                            std::to_string(bytes.size()) + " bytes to rank " +
                            std::to_string(dest) + " (kerasdist bug).");
  }
  Peer& p = peers_[dest];
  const uint32_t n = static_cast<uint32_t>(bytes.size());
  p.out.append(kMagic, sizeof(kMagic));
  p.out.append(reinterpret_cast<const char*>(&n), sizeof(n));
  p.out += bytes;
  return ProgressSends();
}

Status TcpControl::ProgressSends() {
  KD_RETURN_IF_ERROR(broken_);
  if (mesh_->revoked()) return Broken(-1, "");
  for (int r = 0; r < mesh_->size(); ++r) {
    Peer& p = peers_[r];
    while (p.out_at < p.out.size()) {
      ssize_t sent = send(mesh_->fd(r), p.out.data() + p.out_at,
                          p.out.size() - p.out_at, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0 && (errno == EAGAIN || errno == EINTR)) break;
      if (sent <= 0) {
        return Broken(r,
                      "closed its connection (its process ended, or its "
                      "host went down)");
      }
      p.out_at += sent;
    }
    if (p.out_at == p.out.size()) {
      p.out.clear();
      p.out_at = 0;
    }
  }
  return Status::OK();
}

// Everything `peer`'s socket holds now; a closed connection is marked,
// the frames that came before its end still to be taken.
void TcpControl::Read(int peer) {
  Peer& p = peers_[peer];
  char buf[64 << 10];
  while (!p.closed) {
    ssize_t n = recv(mesh_->fd(peer), buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      p.in.append(buf, n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      return;
    } else {
      p.closed = true;
    }
  }
}

bool TcpControl::TakeFrame(int peer, std::string* bytes, Status* error) {
  Peer& p = peers_[peer];
  const size_t have = p.in.size() - p.in_at;
  if (have < kFrameHeader) return false;
  uint32_t n = 0;
  std::memcpy(&n, p.in.data() + p.in_at + 4, sizeof(n));
  if (std::memcmp(p.in.data() + p.in_at, kMagic, sizeof(kMagic)) != 0 ||
      n > kMaxFrame) {
    *error = Broken(peer, "sent something that is not a control frame");
    return false;
  }
  if (have < kFrameHeader + n) return false;
  bytes->assign(p.in, p.in_at + kFrameHeader, n);
  p.in_at += kFrameHeader + n;
  if (p.in_at == p.in.size()) {
    p.in.clear();
    p.in_at = 0;
  }
  return true;
}

Status TcpControl::PollControl(bool* got, int* src, std::string* bytes) {
  *got = false;
  KD_RETURN_IF_ERROR(ProgressSends());
  const int n = mesh_->size();
  for (int k = 0; k < n; ++k) {
    const int peer = (next_ + k) % n;
    if (peer == mesh_->rank()) continue;
    Status error;
    if (!TakeFrame(peer, bytes, &error)) {
      KD_RETURN_IF_ERROR(error);
      Read(peer);
      if (!TakeFrame(peer, bytes, &error)) {
        KD_RETURN_IF_ERROR(error);
        continue;
      }
    }
    *got = true;
    *src = peer;
    next_ = (peer + 1) % n;
    return Status::OK();
  }
  return Status::OK();
}

void TcpControl::FlushSends(double timeout_s) {
  const double until = MonotonicSeconds() + timeout_s;
  while (ProgressSends().ok() && MonotonicSeconds() < until) {
    std::vector<pollfd> waiting;
    for (int r = 0; r < mesh_->size(); ++r) {
      if (!peers_[r].out.empty()) waiting.push_back({mesh_->fd(r), POLLOUT, 0});
    }
    if (waiting.empty()) return;
    poll(waiting.data(), waiting.size(), 10);
  }
}

}  // namespace kerasdist::core
