// A job's transport over TCP, as MpiContext (mpi_context.h) is over MPI:
// two meshes (tcp_mesh.h) among the ranks of one generation, the data
// mesh under the backends' communicators and the control mesh under the
// negotiation's channel, the topology from the ranks' host names, and a
// revocation that fails every rank's pending calls. Forming it again
// (a lost rank, a grown job) is dropping it and forming a new one, with
// the next generation, among the ranks the job has: nothing of MPI's
// process manager in between (docs/architecture.md, "A transport that can
// be formed again"). The runtime runs over it where kd.init() formed one
// (tcp_job.h).
#ifndef KERASDIST_CORE_TRANSPORT_TCP_CONTEXT_H_
#define KERASDIST_CORE_TRANSPORT_TCP_CONTEXT_H_

#include <memory>
#include <string>
#include <vector>

#include "job_transport.h"
#include "tcp_communicator.h"
#include "tcp_control.h"

namespace kerasdist::core {

struct TcpContextOptions {
  // Rank, size, key, generation and timeouts; `addresses` are every
  // rank's data listener.
  TcpMeshOptions mesh;
  std::vector<std::string> control_addresses;  // every rank's, by rank
  std::string host;                            // this rank's host name
};

class TcpContext : public JobTransport {
 public:
  // Forms both meshes (data first) and learns every rank's host.
  static Status Form(const TcpContextOptions& opt, int data_listen_fd,
                     int control_listen_fd, std::unique_ptr<TcpContext>* out);

  std::string Name() const override { return "tcp"; }
  const Topology& topology() const override { return topo_; }
  const std::vector<std::string>& hosts() const { return hosts_; }

  Status SendControl(int dest, std::string bytes) override {
    return control_->SendControl(dest, std::move(bytes));
  }
  Status PollControl(bool* got, int* src, std::string* bytes) override {
    return control_->PollControl(got, src, bytes);
  }
  Status ProgressSends() override { return control_->ProgressSends(); }
  void FlushSends(double timeout_s) override {
    control_->FlushSends(timeout_s);
  }

  // The backends' communicators (MakeNodeCommunicators), over the data
  // mesh; the context must outlive them.
  void MakeCommunicators(std::unique_ptr<Communicator>* all,
                         std::unique_ptr<Communicator>* node,
                         std::unique_ptr<Communicator>* leaders) override {
    MakeNodeCommunicators(data_, hosts_, all, node, leaders);
  }
  // From any thread: every pending and later call on this context's
  // communicators and channel fails here ("revoked: `why`"), and on the
  // other ranks as their connections to this one end.
  void Revoke(const std::string& why) {
    data_->Revoke(why);
    control_->Revoke(why);
  }
  void Revoke() override { Revoke("after a lost rank"); }

 private:
  TcpContext() = default;
  std::shared_ptr<TcpMesh> data_;
  std::unique_ptr<TcpControl> control_;
  std::vector<std::string> hosts_;
  Topology topo_;
};

// Rank `rank`'s place among ranks whose hosts are `hosts` (by rank), as
// MPI's split by node gives it.
Topology TopologyOf(const std::vector<std::string>& hosts, int rank);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_TCP_CONTEXT_H_
