// kd.init() over TCP (KERASDIST_TRANSPORT=tcp): the Python side meets the
// other ranks at the rendezvous, opens this rank's two listeners, learns
// every rank's, and hands the core the job's description (SetTcpJob,
// through the C API) before it starts the runtime, which then forms its
// transport from it (FormTcpJob) instead of starting MPI.
//
// The description: one "name=value" line each of rank, size, generation,
// key (hex), host, data_fd, control_fd (this rank's listeners, which the
// core closes once formed), data and control (every rank's listener,
// "a.b.c.d:port", comma-separated, by rank), and optionally
// connect_timeout_s and timeout_s (TcpMeshOptions').
#ifndef KERASDIST_CORE_TRANSPORT_TCP_JOB_H_
#define KERASDIST_CORE_TRANSPORT_TCP_JOB_H_

#include <memory>
#include <string>

#include "tcp_context.h"

namespace kerasdist::core {

struct TcpJobSpec {
  TcpContextOptions options;
  int data_fd = -1;
  int control_fd = -1;
};

// A malformed description fails naming the line.
Status ParseTcpJob(const std::string& text, TcpJobSpec* out);

// The description for the next runtime's start ("" withdraws it); checked
// here, so that a malformed one fails the call that gave it.
Status SetTcpJob(const std::string& text);
bool TcpJobPending();
// Forms the pending job's transport and withdraws the description (a
// failed start needs a new one: its listeners are closed either way).
Status FormTcpJob(std::unique_ptr<JobTransport>* out);

// Recovery in place over TCP (KERASDIST_RECOVER_IN_PLACE=1): a lost rank
// revokes the transport instead of ending the process, and the next
// kd.init() forms the job's next generation among the survivors
// (kerasdist/rendezvous/reform.py). Needs no ULFM.
bool TcpRecoveryOn();

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_TCP_JOB_H_
