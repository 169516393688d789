// Where each rank's bytes go in the collectives whose sizes differ by rank,
// as pure functions of the coordinator's response: shared by the host (MPI)
// and device (NCCL) paths so that both lay out data identically.
#ifndef KERASDIST_CORE_LAYOUT_H_
#define KERASDIST_CORE_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "message.h"

namespace kerasdist::core {

struct Layout {
  std::vector<int64_t> out_shape;    // this rank's result
  std::vector<int64_t> send_bytes;   // alltoall: to each rank
  std::vector<int64_t> recv_bytes;   // allgather/alltoall: from each rank
  std::vector<int64_t> recv_splits;  // alltoall: rows from each rank
  std::vector<int64_t> counts;       // reducescatter: elements per rank
};

// `local` is this rank's request; `resp` the coordinator's response for it.
Layout AllgatherLayout(const Response& resp, const Request& local);
Layout AlltoallLayout(const Response& resp, const Request& local, int rank,
                      int size);
// Rows of the first dimension go to ranks in order, earlier ranks taking one
// more when they do not divide evenly.
Layout ReducescatterLayout(const Request& local, int rank, int size);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_LAYOUT_H_
