#include "sockets.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

namespace kerasdist::core {

double MonotonicSeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void SetNonBlocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string ErrnoText(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

Status ListenTcp(const std::string& address, const char* what, int* fd,
                 int* port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  if (!address.empty() &&
      inet_pton(AF_INET, address.c_str(), &sa.sin_addr) != 1) {
    return Status::InvalidArgument(std::string(what) + ": '" + address +
                                   "' is not an IPv4 address");
  }
  int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return Status::Internal(ErrnoText(what));
  socklen_t len = sizeof(sa);
  if (bind(s, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      listen(s, 1024) != 0 ||
      getsockname(s, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    Status st = Status::Internal(ErrnoText(what));
    close(s);
    return st;
  }
  *fd = s;
  *port = ntohs(sa.sin_port);
  return Status::OK();
}

int ConnectWithTimeout(const std::string& address, int port, double timeout_s) {
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
    if (poll(&p, 1, static_cast<int>(timeout_s * 1000)) == 1) {
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

bool ReadExactly(int fd, size_t n, double timeout_s, std::string* out) {
  out->assign(n, '\0');
  size_t got = 0;
  const double until = MonotonicSeconds() + timeout_s;
  while (got < n && MonotonicSeconds() < until) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) != 1) continue;
    ssize_t r = recv(fd, &(*out)[got], n - got, 0);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return false;
    if (r > 0) got += r;
  }
  return got == n;
}

bool SendAll(int fd, const std::string& data, double timeout_s) {
  size_t sent = 0;
  const double until = MonotonicSeconds() + timeout_s;
  while (sent < data.size() && MonotonicSeconds() < until) {
    ssize_t n = send(fd, data.data() + sent, data.size() - sent,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += n;
    } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return false;
    } else {
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 100);
    }
  }
  return sent == data.size();
}

}  // namespace kerasdist::core
