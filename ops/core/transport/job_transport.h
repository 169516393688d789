// What the runtime needs of a job's transport, whichever it is: the ranks'
// topology, the control channel of the negotiation, the backends'
// communicators, and recovery's revocation. MpiContext (mpi_context.h)
// implements it over MPI, TcpContext (tcp_context.h) over TCP meshes that
// a running process can drop and form again.
#ifndef KERASDIST_CORE_TRANSPORT_JOB_TRANSPORT_H_
#define KERASDIST_CORE_TRANSPORT_JOB_TRANSPORT_H_

#include <memory>
#include <string>

#include "../control/control_channel.h"
#include "communicator.h"
#include "topology.h"

namespace kerasdist::core {

class JobTransport : public ControlChannel {
 public:
  // "mpi" or "tcp": what kerasdist.transport() reports.
  virtual std::string Name() const = 0;
  virtual const Topology& topology() const = 0;
  // The communicators over every rank, over this node's ranks, and (null
  // but on each node's first rank) over one leader per node: the backends'
  // (backends.h, NodeContext). The transport must outlive them.
  virtual void MakeCommunicators(std::unique_ptr<Communicator>* all,
                                 std::unique_ptr<Communicator>* node,
                                 std::unique_ptr<Communicator>* leaders) = 0;
  // From any thread: every pending and later call on this transport's
  // communicators fails, on every rank, with Status::RanksLost.
  virtual void Revoke() = 0;
  // Once the runtime's thread has stopped after a lost rank: whatever the
  // transport does for the survivors before the next kd.init() (MPI's
  // shrink; nothing where that init forms a new transport).
  virtual void Reform(double deadline_s) {}
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_JOB_TRANSPORT_H_
