// Allreduce that reads the other ranks' tensors where they are, with Linux
// cross-memory attach (process_vm_readv), for jobs whose ranks all run on one
// node.
//
// The slot path (shm_allreduce.h) first copies every rank's input into shared
// memory so that the others can see it. Here nothing is staged: a call goes
//   1. every rank learns the others' input and output addresses (one small
//      allgather over the node's Communicator, which is also the
//      start-line);
//   2. rank r reduces its piece r of the batch (the tensors taken as one
//      flat array): it reads piece r of each rank's input in order, its own
//      from memory and the others' through the kernel, 256 KiB at a time into
//      a buffer that stays in cache, and writes the scaled result straight
//      into its outputs; barrier;
//   3. rank r reads every other piece k from rank k's outputs straight into
//      its own; barrier (after it the others no longer read our memory, and
//      the front end may free it). With two ranks, step 2 also writes each
//      256 KiB of result into the peer's outputs while it is in cache
//      (process_vm_writev), and step 3 and its barrier are skipped.
// Each element is reduced by one rank only, so every rank ends with the same
// bits. Pieces are disjoint, so an output may be its own input (in place).
// With two ranks on 2 cores here an 8 MiB allreduce fell from 1.9 ms (slots)
// to 1.3 ms: a rank's bytes cross memory once instead of three times.
//
// process_vm_readv/writev need ptrace access to the peer: each rank allows it
// with PR_SET_PTRACER (Yama), and at start-up every rank reads a probe word
// from every other and writes one into its mailbox; unless all succeed (a
// seccomp filter, a hardened kernel) the ranks agree to use the slots instead.
#ifndef KERASDIST_CORE_BACKENDS_CMA_ALLREDUCE_H_
#define KERASDIST_CORE_BACKENDS_CMA_ALLREDUCE_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "../status.h"
#include "../transport/communicator.h"
#include "../types.h"

namespace kerasdist::core {

class CmaAllreduce {
 public:
  // One tensor of a batch: `count` elements of `in`, reduced into `out`
  // (which may equal `in`).
  struct Segment {
    const void* in;
    void* out;
    int64_t count;
  };

  // Over `node` (every rank of the list, on this node; null: not one node),
  // which must outlive it. Sets *out to null (and returns OK) unless `node`
  // is given, every rank of `comm` has `enabled`, and every rank can read
  // every other rank's memory. Collective over `comm`.
  // `min_tensor_bytes`: see min_tensor_bytes(); the ranks use the largest.
  static Status Create(Communicator* comm, Communicator* node, bool enabled,
                       int64_t min_tensor_bytes,
                       std::unique_ptr<CmaAllreduce>* out);

  // A batch whose tensors average fewer bytes than this is better staged in
  // the slots (agreed by all ranks at Create).
  int64_t min_tensor_bytes() const { return min_tensor_bytes_; }

  // Collective: every rank passes the same segment counts in the same order
  // (the coordinator's plan). The inputs are reduced with `op` (never
  // Average), scaled as ScaleCopy(factor, divisor) and written to the
  // outputs. *mark1 / *mark2 receive the time at the end of steps 1 and 2,
  // for the timeline.
  using TimePoint = std::chrono::steady_clock::time_point;
  Status Allreduce(const std::vector<Segment>& segs, DataType dt, ReduceOp op,
                   double factor, int64_t divisor, TimePoint* mark1,
                   TimePoint* mark2);

 private:
  CmaAllreduce() = default;
  // Copies elements [lo, hi) of rank k's inputs (outputs when `outputs`)
  // into `dst`, or into this rank's outputs over the same range when dst is
  // null. With `write` the other way: from there into rank k's tensors.
  Status Copy(int k, bool outputs, int64_t lo, int64_t hi, char* dst,
              bool write = false);
  // Calls f(s, a, b) for each segment s overlapping elements [lo, hi) of the
  // batch, with [a, b) the overlap (in batch elements, b > a).
  template <typename F>
  void ForEachPiece(int64_t lo, int64_t hi, F&& f) const;

  Communicator* comm_ = nullptr;  // the node's ranks
  int rank_ = 0, size_ = 1;
  int64_t min_tensor_bytes_ = 0;
  std::vector<pid_t> pids_;
  // Per call: every rank's input and output address of each segment
  // (rank-major), the element offsets where segments start, element size.
  std::vector<uint64_t> addrs_;
  std::vector<int64_t> starts_;
  int64_t esize_ = 0;
  // Reused from call to call: the thread's hot path allocates nothing.
  std::vector<char> acc_, tmp_;
  std::vector<uint64_t> mine_;
  std::vector<iovec> local_iov_, remote_iov_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_CMA_ALLREDUCE_H_
