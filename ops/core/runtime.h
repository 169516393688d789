// The runtime: one background thread per process owns all communication.
// Front ends (the TF kernels, the C API) call Enqueue and return at once; the
// thread negotiates with the other ranks, runs the collectives in the
// coordinator's order and completes each entry through its callback.
#ifndef KERASDIST_CORE_RUNTIME_H_
#define KERASDIST_CORE_RUNTIME_H_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "comm/mpi_context.h"
#include "comm/nccl_communicator.h"
#include "comm/cma_allreduce.h"
#include "comm/shm_allreduce.h"
#include "config.h"
#include "controller.h"
#include "message.h"
#include "host_buffer.h"
#include "scale.h"
#include "timeline.h"

namespace kerasdist::core {

struct Result {
  Status status;
  std::vector<int64_t> recv_splits;  // alltoall: rows received from each rank
};

// One tensor handed to the runtime. `output` is the preallocated result for
// allreduce and broadcast (it may equal `input`); allgather, alltoall and
// reducescatter learn their output shape from negotiation and call `allocate`.
// `done` is called exactly once, from the background thread.
struct Entry {
  Request req;
  const void* input = nullptr;
  void* output = nullptr;
  std::function<Status(const std::vector<int64_t>& shape, void** data)> allocate;
  std::function<void(const Result&)> done;
  // Device tensors (req.device >= 0) only, optional: a cudaEvent_t recorded
  // on the stream that produces `input` (TF's compute stream), owned by the
  // front end and valid until `done`. The communication stream waits on it;
  // null means the input is already complete (e.g. the C API after a sync).
  void* ready_event = nullptr;
  // Device tensors with a timeline on: when the batch was queued on the
  // communication stream (its phase ends when the thread sees it finish).
  std::chrono::steady_clock::time_point issued{};
};

class Runtime {
 public:
  static Status Start(const Config& config, bool has_comm, int parent_comm_f,
                      std::unique_ptr<Runtime>* out);
  ~Runtime();  // Stops the thread (as Shutdown) if still running.

  // Checks the request against this rank's facts and queues it. An error here
  // means `done` will not be called.
  Status Enqueue(Entry entry);
  // Enqueue for each entry in order, under one lock and with one wake-up of
  // the thread (a grouped allreduce). Entries from the first failure on are
  // not queued and their `done` will not be called; *queued says how many
  // were, and the failure is returned.
  Status EnqueueMany(std::vector<Entry>& entries, size_t* queued);
  // Tells the other ranks, fails what is still pending, joins the thread.
  void Shutdown();

  const Topology& topology() const { return mpi_->topology(); }
  const Config& config() const { return config_; }

  // Timeline on rank 0 (a no-op elsewhere); start replaces a running one.
  Status StartTimeline(const std::string& path, bool mark_cycles);
  void StopTimeline();

  struct Stats {
    int64_t allreduced_bytes = 0;  // tensor bytes allreduced
    int64_t batches = 0;           // collectives run (a fused batch counts once)
    double busy_seconds = 0;       // inside collectives and fusion copies
    int64_t shm_allreduces = 0;    // allreduces (batches) through shared memory
    int64_t cma_allreduces = 0;    // ... of which read the peers in place (CMA)
  };
  Stats stats() const;
  // Applied by the coordinator (rank 0) from its next decision on; every rank
  // executes the coordinator's plan, so setting them on rank 0 is enough.
  void SetTunables(int64_t fusion_threshold, double cycle_time_ms, bool cache);
  void GetTunables(int64_t* fusion_threshold, double* cycle_time_ms, bool* cache) const;
  // Why the runtime stopped, or OK while it runs.
  Status stopped_status();


 private:
  Runtime() = default;
  void Loop();
  bool RunLoopOnce();
  void IdleWait(int idle_rounds, bool have_pending);
  Status Execute(const CoordinatorMessage& msg);
  Status ExecuteBatch(const std::vector<const Response*>& resps);
  Status RunAllreduce(const std::vector<const Response*>& resps,
                      std::vector<Entry*>& entries);
  // The shared-memory allreduce of `entries`, when it applies; *ran says
  // whether it did (the same on every rank).
  Status RunShmAllreduce(const std::vector<const Response*>& resps,
                         std::vector<Entry*>& entries, const Scaling& sc,
                         bool* ran);
  Status RunShmAllreducePieces(const std::vector<const Response*>& resps,
                               Entry& e, const Scaling& sc, bool* ran);
  Status RunOther(const Response& resp, Entry& e, Result* result);
  void Complete(Entry& e, const Result& r);
  // Complete for each of a batch's entries, taking the lock once.
  void CompleteAll(std::vector<Entry>& entries, const Result& r);
  void FailAll(const Status& s);
  Status ValidateLocal(const Request& q) const;
  Status Prepare(Request& q) const;  // fills implied fields, then validates
  Status ExecuteDevice(const std::vector<const Response*>& resps,
                       std::vector<Entry> entries);
  bool PollDevice();

  Config config_;
  std::unique_ptr<MpiContext> mpi_;
  std::unique_ptr<Communicator> host_;
  // Single-node jobs: allreduce through shared memory (null otherwise).
  std::unique_ptr<ShmAllreduce> shm_;
  std::unique_ptr<CmaAllreduce> cma_;  // preferred to shm_ when both exist
  std::vector<CmaAllreduce::Segment> cma_segs_;  // reused by each call
  // The GPU data path, made by the first device batch (collectively: every
  // rank executes that batch at the same point of the coordinator's order).
  std::unique_ptr<DeviceBackend> device_;
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> incoming_;
  std::unordered_set<std::string> in_flight_;  // names queued or pending
  bool shutdown_requested_ = false;
  bool stopped_ = false;
  Status stopped_status_;

  // Background-thread state.
  std::unordered_map<std::string, Entry> pending_;
  std::unique_ptr<ResponseCache> cache_;
  std::unique_ptr<Coordinator> coordinator_;
  HostBuffer fusion_buffer_;
  bool sent_shutdown_ = false;
  // Poll rather than sleep while collectives are in flight (kPendingSpin);
  // off when this node's ranks outnumber their CPUs, where the polling
  // thread would take a core another rank is computing on.
  bool spin_while_pending_ = true;
  Clock::time_point shutdown_sent_at_;
  Clock::time_point last_work_;
  Clock::time_point last_stall_check_;
  Clock::time_point first_ready_;
  bool ready_waiting_ = false;

  std::shared_ptr<Timeline> CurrentTimeline();
  void RecordBatch(const std::vector<const Response*>& resps, const char* phase,
                   Clock::time_point start, Clock::time_point end,
                   const std::string& args);
  // A fused batch's three phases: copy in, the collective (with `args`),
  // copy out (ending now). Call only with a timeline.
  void RecordFusedBatch(const std::vector<const Response*>& resps,
                        Clock::time_point packed_from, Clock::time_point reduced_from,
                        Clock::time_point unpacked_from, const std::string& args);
  mutable std::mutex timeline_mu_;
  std::shared_ptr<Timeline> timeline_;
  std::shared_ptr<Timeline> loop_timeline_;  // the loop's copy for this round
  std::unordered_map<std::string, Clock::time_point> ready_at_;

  std::atomic<int64_t> stat_bytes_{0};
  std::atomic<int64_t> stat_batches_{0};
  std::atomic<int64_t> stat_busy_ns_{0};
  std::atomic<int64_t> stat_shm_{0};
  std::atomic<int64_t> stat_cma_{0};
  std::atomic<int64_t> tune_threshold_{0};
  std::atomic<double> tune_cycle_ms_{0.0};
  std::atomic<bool> tune_cache_{true};
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_RUNTIME_H_
