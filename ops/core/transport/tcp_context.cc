#include "tcp_context.h"

namespace kerasdist::core {

Topology TopologyOf(const std::vector<std::string>& hosts, int rank) {
  Topology t;
  t.rank = rank;
  t.size = static_cast<int>(hosts.size());
  std::vector<int> local(hosts.size(), 0);  // each rank's local rank
  for (int r = 0; r < t.size; ++r) {
    for (int q = 0; q < r; ++q) local[r] += hosts[q] == hosts[r];
  }
  t.local_rank = local[rank];
  t.local_size = 0;
  t.cross_rank = 0;
  t.cross_size = 0;
  for (int r = 0; r < t.size; ++r) {
    t.local_size += hosts[r] == hosts[rank];
    if (local[r] == t.local_rank) {
      t.cross_rank += r < rank;
      ++t.cross_size;
    }
  }
  return t;
}

Status TcpContext::Form(const TcpContextOptions& opt, int data_listen_fd,
                        int control_listen_fd,
                        std::unique_ptr<TcpContext>* out) {
  std::unique_ptr<TcpContext> ctx(new TcpContext());
  std::unique_ptr<TcpMesh> data, control;
  KD_RETURN_IF_ERROR(TcpMesh::Form(opt.mesh, data_listen_fd, &data));
  TcpMeshOptions copt = opt.mesh;
  copt.addresses = opt.control_addresses;
  copt.channel = TcpMeshOptions::kControl;
  KD_RETURN_IF_ERROR(TcpMesh::Form(copt, control_listen_fd, &control));
  ctx->data_ = std::move(data);
  ctx->control_ = std::make_unique<TcpControl>(std::move(control));
  // Every rank's host name: their lengths, then the names.
  TcpCommunicator all(ctx->data_);
  const int n = all.size();
  int64_t mine = static_cast<int64_t>(opt.host.size());
  std::vector<int64_t> lengths(n);
  KD_RETURN_IF_ERROR(
      all.Allgatherv(&mine, lengths.data(), std::vector<int64_t>(n, 8)));
  int64_t total = 0;
  for (int64_t l : lengths) total += l;
  std::string names(total, '\0');
  KD_RETURN_IF_ERROR(all.Allgatherv(opt.host.data(), &names[0], lengths));
  for (int r = 0, at = 0; r < n; at += lengths[r], ++r) {
    ctx->hosts_.push_back(names.substr(at, lengths[r]));
  }
  ctx->topo_ = TopologyOf(ctx->hosts_, opt.mesh.rank);
  *out = std::move(ctx);
  return Status::OK();
}

}  // namespace kerasdist::core
