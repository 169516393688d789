// The runtime: one background thread per process owns all communication.
// Front ends enqueue through the C API (c_api.h), which calls Enqueue and
// returns at once; the thread negotiates with the other ranks, runs the
// collectives in the coordinator's order through the first enabled backend
// of its list (backends/backends.h) and completes each entry through its
// callback.
#ifndef KERASDIST_CORE_RUNTIME_H_
#define KERASDIST_CORE_RUNTIME_H_

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backends/backends.h"
#include "config.h"
#include "control/liveness.h"
#include "controller.h"
#include "entry.h"
#include "message.h"
#include "timeline.h"
#include "transport/job_transport.h"

namespace kerasdist::core {

// What distinguishes a process set's runtime from the job's (process set 0):
// `label` ("process set 1 (ranks 0,2)") starts its errors and stall
// messages; `parent`, the job's runtime, whose stop fails this one's pending
// collectives too (its heartbeat watches every rank, so a set needs none).
struct RuntimeRole {
  std::string label;
  std::shared_ptr<class Runtime> parent;
};

class Runtime {
 public:
  static Status Start(const Config& config, bool has_comm, int parent_comm_f,
                      std::unique_ptr<Runtime>* out,
                      RuntimeRole role = RuntimeRole());
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

  const Topology& topology() const { return transport_->topology(); }
  // "mpi" or "tcp" (JobTransport::Name).
  std::string transport_name() const { return transport_->Name(); }
  const Config& config() const { return config_; }
  // The backends in the order batches try them ("nccl,cma,shm,mpi"...).
  std::string BackendNames() const;

  // Timeline on rank 0 (a no-op elsewhere); start replaces a running one.
  Status StartTimeline(const std::string& path, bool mark_cycles);
  void StopTimeline();

  struct Stats {
    int64_t allreduced_bytes = 0;  // tensor bytes allreduced
    int64_t batches = 0;      // collectives run (a fused batch counts once)
    double busy_seconds = 0;  // inside collectives and fusion copies
  };
  Stats stats() const;
  // Batches each backend of the list ran, by name (a batch one backend hands
  // to another counts for the one that ran it): every backend is counted.
  int64_t BackendRuns(const char* name) const;
  // Applied by the coordinator (rank 0) from its next decision on; every rank
  // executes the coordinator's plan, so setting them on rank 0 is enough.
  void SetTunables(int64_t fusion_threshold, double cycle_time_ms, bool cache);
  void GetTunables(int64_t* fusion_threshold, double* cycle_time_ms,
                   bool* cache) const;
  // Why the runtime stopped, or OK while it runs.
  Status stopped_status();
  // Whether it has stopped (no lock: the loop of a set's runtime polls it).
  bool has_stopped() const { return stopped_flag_.load(); }
  const std::string& label() const { return role_.label; }

 private:
  // The transport (a TCP job's where kd.init() described one, else MPI's),
  // the backends' communicators and the heartbeat.
  Status StartTransport(bool has_comm, int parent_comm_f);
  // A batch an asynchronous backend (a GPU stream) is still running.
  struct AsyncBatch {
    std::vector<Entry> entries;
    Result result;  // its status comes from the backend
    Clock::time_point issued;
    const char* backend;  // the backend that runs it (its Name())
    int device;
  };

  Runtime() = default;
  // The loop, one round at a time: take what the front ends queued, run a
  // coordinator's or a worker's round of negotiation (each executes what was
  // decided), collect what asynchronous backends finished, wait if idle.
  void Loop();
  bool RunLoopOnce();
  bool TakeIncoming(RankMessage* msg);
  Status CoordinatorRound(const RankMessage& mine, bool* worked);
  Status WorkerRound(const RankMessage& mine, bool* worked);
  Status ReceiveFromWorkers(bool* worked);
  Status CheckStalls(Clock::time_point now, bool* stopped);
  bool HoldForFusion(Clock::time_point now);
  Status DecideAndRun(Clock::time_point now);
  bool PollBackends();
  void IdleWait(int idle_rounds, bool have_pending);
  void SayGoodbye();

  // Executing the coordinator's decisions.
  Status Execute(const CoordinatorMessage& msg);
  Status ExecuteBatch(const std::vector<const Response*>& resps);
  Entry ZeroEntry(const Response& r);
  Status TakeEntries(const std::vector<const Response*>& resps,
                     std::vector<Entry>* entries);
  Status PrepareBatch(const Response& head, std::vector<Entry>& entries,
                      CollectiveBatch* b, Result* result);
  Status RunBatch(const std::vector<const Response*>& resps,
                  std::vector<Entry>& entries, CollectiveBatch& b,
                  Result& result);
  void CountRun(const CollectiveBatch& b, Clock::time_point start);

  void Complete(Entry& e, const Result& r);
  // Complete for each of a batch's entries, taking the lock once.
  void CompleteAll(std::vector<Entry>& entries, const Result& r);
  void FailAll(const Status& s);
  // A process set's runtime, its job's runtime stopped: FailAll.
  void FailWithParent();
  void RevokeJob();
  // `message` prefixed with this runtime's label (a process set's).
  std::string Labelled(const std::string& message) const;

  // Timeline.
  std::shared_ptr<Timeline> CurrentTimeline();
  void RecordQueued(const std::vector<const Response*>& resps,
                    Clock::time_point start);
  void RecordBatch(const std::vector<const Response*>& resps, const char* phase,
                   Clock::time_point start, Clock::time_point end,
                   const std::string& args);
  void RecordRun(const std::vector<const Response*>& resps,
                 const CollectiveBatch& b, Clock::time_point start);
  void RecordAsync(const AsyncBatch& a);

  Config config_;
  RuntimeRole role_;
  std::atomic<bool> stopped_flag_{false};
  std::unique_ptr<JobTransport> transport_;
  std::unique_ptr<Liveness> liveness_;  // the heartbeat; empty at one rank
  // MPI over this runtime's ranks, this node's ranks, one leader per node
  // (null but on the leaders): the backends' communicators.
  std::unique_ptr<Communicator> host_, node_, leaders_;
  BackendList backends_;  // first enabled wins
  std::unique_ptr<std::atomic<int64_t>[]> backend_runs_;
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
  std::unordered_map<uint64_t, AsyncBatch> async_;
  uint64_t next_tag_ = 1;
  std::unique_ptr<ResponseCache> cache_;
  std::unique_ptr<Coordinator> coordinator_;
  bool sent_shutdown_ = false;
  // This rank called join() and it has not returned: it runs the
  // allreduces it did not submit with zeros.
  bool joined_ = false;
  // Rank 0: which ranks have sent their last control message (a shutdown).
  std::vector<bool> said_goodbye_;
  // Poll rather than sleep while collectives are in flight (kPendingSpin);
  // off when this node's ranks outnumber their CPUs, where the polling
  // thread would take a core another rank is computing on.
  bool spin_while_pending_ = true;
  Clock::time_point shutdown_sent_at_;
  Clock::time_point last_work_;
  Clock::time_point last_stall_check_;
  Clock::time_point first_ready_;
  bool ready_waiting_ = false;

  mutable std::mutex timeline_mu_;
  std::shared_ptr<Timeline> timeline_;
  std::shared_ptr<Timeline> loop_timeline_;  // the loop's copy for this round
  std::unordered_map<std::string, Clock::time_point> ready_at_;

  std::atomic<int64_t> stat_bytes_{0};
  std::atomic<int64_t> stat_batches_{0};
  std::atomic<int64_t> stat_busy_ns_{0};
  std::atomic<int64_t> tune_threshold_{0};
  std::atomic<double> tune_cycle_ms_{0.0};
  std::atomic<bool> tune_cache_{true};
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_RUNTIME_H_
