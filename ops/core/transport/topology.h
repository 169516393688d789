// Where a rank sits in its job, as Horovod names it: its rank among all,
// among its host's ranks (local) and among the ranks of every host with
// its local rank (cross: on hosts of equal size, its host's index).
#ifndef KERASDIST_CORE_TRANSPORT_TOPOLOGY_H_
#define KERASDIST_CORE_TRANSPORT_TOPOLOGY_H_

namespace kerasdist::core {

struct Topology {
  int rank = 0, size = 1;
  int local_rank = 0, local_size = 1;
  int cross_rank = 0, cross_size = 1;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_TOPOLOGY_H_
