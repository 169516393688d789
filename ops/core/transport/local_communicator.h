// The in-process transport: N ranks that are threads of one process, sharing
// a LocalGroup (like gloo's and c10d's in-memory stores). Every collective of
// communicator.h runs as publish (each rank posts its buffers in the group's
// table), a barrier, each rank computing its own result from its peers'
// buffers, and a second barrier before anyone may touch its buffers again.
// It exists for the core's tests: negotiation, fusion and the backends'
// reduce logic run in milliseconds, in orders and timings the tests choose.
//
// It cannot hang: a rank that leaves (Leave(), or its communicator's
// destructor) makes its peers' pending and later calls fail with a Status
// naming it, and every wait gives up after the group's timeout, naming the
// ranks that never arrived.
#ifndef KERASDIST_CORE_TRANSPORT_LOCAL_COMMUNICATOR_H_
#define KERASDIST_CORE_TRANSPORT_LOCAL_COMMUNICATOR_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "communicator.h"

namespace kerasdist::core {

// What one rank passed to the collective in progress (see LocalCommunicator).
struct LocalSlot {
  const char* collective = "";
  const void* in = nullptr;
  void* out = nullptr;
  int64_t count = 0;  // elements (reductions) or bytes (broadcast)
  DataType dtype = DataType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  const std::vector<int64_t>* sizes =
      nullptr;  // allgather, reducescatter, alltoall send
  const std::vector<int64_t>* recv_sizes = nullptr;  // alltoall
};

class LocalGroup {
 public:
  // `timeout_s`: how long a rank waits for its peers at a barrier before its
  // call fails (and the group with it).
  explicit LocalGroup(int size, double timeout_s = 30.0);
  int size() const { return size_; }

  // Posts `slot` as `rank`'s part of the collective in progress.
  void Publish(int rank, const LocalSlot& slot) { slots_[rank] = slot; }
  const LocalSlot& slot(int rank) const { return slots_[rank]; }
  // Returns once every rank has arrived (`what`: the collective, for errors).
  // Fails if a rank left the group or the timeout passed; the group is then
  // broken and every later call fails too.
  Status Arrive(int rank, const char* what);
  // `rank` leaves: peers waiting now, and every later call, fail naming it.
  void Leave(int rank, const std::string& why);
  // Point to point: posts `send` for `dest`, waits for `source`'s message
  // to `rank` and copies it into `recv` (its size must be `recv_bytes`),
  // then waits until `dest` has taken `send`. Fails as Arrive does.
  Status Exchange(int rank, const void* send, int64_t send_bytes, int dest,
                  void* recv, int64_t recv_bytes, int source);

 private:
  Status BrokenLocked() const;
  // Waits on `cv_` until `done()` or the group breaks; false on timeout.
  template <typename Done>
  bool WaitLocked(std::unique_lock<std::mutex>& l, Done done);
  // One message of Exchange, from one rank to another.
  struct Mail {
    const void* data = nullptr;
    int64_t bytes = 0;
    bool posted = false, taken = false;
  };

  const int size_;
  const double timeout_s_;
  std::vector<LocalSlot> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;  // completed barriers
  std::vector<bool> here_;   // arrived at the barrier in progress
  int arrived_ = 0;
  std::string broken_;      // non-empty: why every call fails
  std::vector<Mail> mail_;  // [from * size + to]
};

class LocalCommunicator : public Communicator {
 public:
  // `group` is shared by the ranks' communicators, one per thread.
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank);
  // Leaves the group: a peer still calling collectives fails, naming this rank.
  ~LocalCommunicator() override;
  LocalCommunicator(const LocalCommunicator&) = delete;
  LocalCommunicator& operator=(const LocalCommunicator&) = delete;

  // Leaves now (an aborting rank); later calls of this rank fail too.
  void Abort(const std::string& why);
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  std::string Name() const override { return "local"; }
  Status Allreduce(void* buf, int64_t count, DataType dt, ReduceOp op) override;
  Status AllreduceFrom(const void* in, void* out, int64_t count, DataType dt,
                       ReduceOp op) override;
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes) override;
  Status Gatherv(const void* in, void* out, const std::vector<int64_t>& bytes,
                 int root) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes) override;
  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dt,
                       ReduceOp op) override;
  Status Barrier() override;
  Status SendRecv(const void* send, int64_t send_bytes, int dest, void* recv,
                  int64_t recv_bytes, int source) override;

 private:
  // Publishes `mine`, waits for every rank, checks that they called the
  // same collective with agreeing arguments, and runs `compute` (which
  // reads peers' slots and writes only this rank's scratch or output); then
  // waits until every rank has finished reading before `finish` (which may
  // write this rank's own buffers).
  template <typename Compute, typename Finish>
  Status Collective(const LocalSlot& mine, Compute compute, Finish finish);
  Status Agree(const LocalSlot& mine) const;

  std::shared_ptr<LocalGroup> group_;
  const int rank_;
  bool left_ = false;
  std::vector<char> scratch_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_LOCAL_COMMUNICATOR_H_
