// TCP helpers shared by the heartbeat (control/liveness.h) and the TCP
// transport (tcp_mesh.h): IPv4 only, every wait with a deadline, no
// SIGPIPE (MSG_NOSIGNAL), sockets close-on-exec.
#ifndef KERASDIST_CORE_TRANSPORT_SOCKETS_H_
#define KERASDIST_CORE_TRANSPORT_SOCKETS_H_

#include <string>

#include "../status.h"

namespace kerasdist::core {

// Seconds on the steady clock.
double MonotonicSeconds();
// Non-blocking, and TCP_NODELAY (small frames go at once).
void SetNonBlocking(int fd);
// "what: <strerror(errno)>".
std::string ErrnoText(const char* what);
// A listening socket on `address` ("": every interface), the port chosen
// by the OS; `what` starts the error ("heartbeat listen").
Status ListenTcp(const std::string& address, const char* what, int* fd,
                 int* port);
// A non-blocking connected socket, or -1 when `address` is not IPv4, the
// peer refused or `timeout_s` passed.
int ConnectWithTimeout(const std::string& address, int port, double timeout_s);
// Reads exactly `n` bytes into *out, waiting up to `timeout_s`; false when
// the peer closed, failed or was too slow.
bool ReadExactly(int fd, size_t n, double timeout_s, std::string* out);
// Sends all of `data` within `timeout_s`; false otherwise.
bool SendAll(int fd, const std::string& data, double timeout_s);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_SOCKETS_H_
