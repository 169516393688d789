#include "runtime.h"

#include <sys/prctl.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>

#include "backends/gpu/device_backend.h"
#include "layout.h"
#include "scale.h"
#include "transport/mpi_context.h"
#include "transport/tcp_job.h"
#include "validate.h"

namespace kerasdist::core {

namespace {

// How long the thread keeps polling after its last piece of work before it
// starts to sleep, and the longest sleep while this rank has tensors in flight
// or not. Spinning longer steals a core from TensorFlow (with 2 ranks on 2
// cores there is no spare one); sleeping longer adds latency.
constexpr auto kSpin = std::chrono::microseconds(60);
// What every RanksLost message says (kerasdist/_core/errors.py's
// RANKS_LOST_TEXT; MpiStatus's words under ULFM).
constexpr char kRanksLostText[] = "a rank of the job was lost";
// While this rank has submitted collectives that have not run yet, the
// callers are usually blocked on them and the other ranks' requests or the
// coordinator's answer may arrive at any moment: the thread keeps polling
// (yielding the core to any runnable thread) for this long before it sleeps.
// A sleep there costs the whole step its wake-up latency, on every rank that
// slept: with 128 small tensors per step, 1.1 ms a step instead of 0.6 ms.
// Not where this node's ranks outnumber their CPUs (spin_while_pending_):
// there the polling took cores other ranks compute on (MLP-20 at np=4 on 2
// cores: 25% fewer images/s).
constexpr auto kPendingSpin = std::chrono::milliseconds(5);
constexpr int64_t kMaxSleepPendingUs = 200;
constexpr int64_t kMaxSleepIdleUs = 2000;
constexpr double kShutdownReplyTimeoutS = 30.0;
// How long rank 0 waits, as it stops, for the other ranks' last control
// messages (a rank that died never sends one).
constexpr double kGoodbyeTimeoutS = 2.0;
// With recovery in place (mpi_context.h), a rank the heartbeat lost ends no
// survivor: its line says so, and the runtime's communicators are revoked,
// so that every survivor's collectives fail with RanksLost and the runtime
// re-forms (Loop). Otherwise empty: the heartbeat ends the process.
std::function<void(const std::string&)> OnLost(JobTransport* transport,
                                               bool recovery) {
  if (!recovery) return {};
  return [transport](const std::string& line) {
    std::string text = line;
    const std::string ending = "; ending this rank.";
    const size_t at = text.rfind(ending);
    if (at != std::string::npos) {
      text.replace(at, ending.size(),
                   "; the survivors go on without it (recovery in place).");
    }
    std::fputs(text.c_str(), stderr);
    std::fflush(stderr);
    transport->Revoke();
  };
}

// How long the survivors have to re-form (MpiContext::Reform): the
// heartbeat's timeout, or 60 s without a heartbeat.
double ReformDeadlineS(const Config& config) {
  return config.heartbeat_timeout_s > 0
             ? std::max(10.0, config.heartbeat_timeout_s)
             : 60.0;
}

// The args of a batch's timeline event.
std::string BatchArgs(const CollectiveBatch& b) {
  return "\"bytes\":" + std::to_string(b.bytes()) +
         ",\"fused\":" + std::to_string(b.tensors.size()) + ",\"dtype\":\"" +
         DataTypeName(b.dtype) + "\",\"backend\":\"" + b.backend + "\"";
}

}  // namespace

Status Runtime::Start(const Config& config, bool has_comm, int parent_comm_f,
                      std::unique_ptr<Runtime>* out, RuntimeRole role) {
  std::unique_ptr<Runtime> rt(new Runtime());
  rt->config_ = config;
  rt->role_ = std::move(role);
  // The start-up watch, armed by MpiContext::Create, ends with the start
  // (the heartbeat reports a lost rank from here on). A rank whose start
  // fails once MPI runs must not wait in MPI_Finalize at exit for ranks
  // that wait for it in turn.
  struct EndWatch {
    bool started = false;
    ~EndWatch() {
      EndStartupWatch();
      if (!started) SkipFinalizeAtExit();
    }
  } end_watch;
  KD_RETURN_IF_ERROR(rt->StartTransport(has_comm, parent_comm_f));
  bool oversubscribed = false;
  KD_RETURN_IF_ERROR(NodeOversubscribed(*rt->node_, &oversubscribed));
  rt->spin_while_pending_ = !oversubscribed;
  NodeContext ctx;
  ctx.comm = rt->host_.get();
  ctx.node = rt->node_.get();
  ctx.leaders = rt->leaders_.get();
  KD_RETURN_IF_ERROR(MakeBackends(config, ctx, &rt->backends_));
  rt->backend_runs_.reset(new std::atomic<int64_t>[rt->backends_.size()]());
  rt->cache_ = std::make_unique<ResponseCache>(config.cache_capacity);
  if (rt->topology().rank == 0) {
    rt->coordinator_ =
        std::make_unique<Coordinator>(rt->topology().size, config);
  }
  rt->tune_threshold_ = config.fusion_threshold_bytes;
  rt->tune_cycle_ms_ = config.cycle_time_ms;
  rt->tune_cache_ = config.cache_capacity > 0;
  Status timeline = Status::OK();
  if (!config.timeline_path.empty()) {
    timeline =
        rt->StartTimeline(config.timeline_path, config.timeline_mark_cycles);
  }
  // Rank 0 alone opens the timeline: every rank learns whether it could,
  // so that kd.init() fails on all of them, not on rank 0 alone while the
  // others wait for it in their first collective.
  KD_RETURN_IF_ERROR(AgreeStarted(*rt->host_, timeline));
  rt->last_stall_check_ = Clock::now();
  rt->last_work_ = Clock::now();
  rt->thread_ = std::thread(&Runtime::Loop, rt.get());
  end_watch.started = true;
  *out = std::move(rt);
  return Status::OK();
}

Status Runtime::StartTransport(bool has_comm, int parent_comm_f) {
  if (!has_comm && !role_.parent && TcpJobPending()) {
    KD_RETURN_IF_ERROR(FormTcpJob(&transport_));
  } else {
    std::unique_ptr<MpiContext> mpi;
    KD_RETURN_IF_ERROR(MpiContext::Create(has_comm, parent_comm_f, &mpi));
    transport_ = std::move(mpi);
  }
  transport_->MakeCommunicators(&host_, &node_, &leaders_);
  LivenessStart start;
  start.interval_s = config_.heartbeat_interval_s;
  start.timeout_s = config_.heartbeat_timeout_s;
  start.interface = config_.network_interface;
  // Recovery in place: MPI's communicator shrinks (ULFM); a TCP job forms
  // its next generation in the next kd.init().
  start.recovery = transport_->Name() == "mpi" ? RecoveryOn() : TcpRecoveryOn();
  start.on_lost = OnLost(transport_.get(), start.recovery);
  // Over TCP nothing else tells the survivors of a loss (MPI's ULFM does):
  // the heartbeat's word goes out at once, naming what it knows then.
  if (start.recovery && transport_->Name() == "tcp") start.settle_s = 0;
  return StartLiveness(*host_, start, &liveness_);
}

Runtime::~Runtime() {
  Shutdown();
  StopTimeline();
}

Status Runtime::StartTimeline(const std::string& path, bool mark_cycles) {
  if (topology().rank != 0) return Status::OK();
  std::shared_ptr<Timeline> t;
  KD_RETURN_IF_ERROR(Timeline::Open(path, mark_cycles, &t));
  std::lock_guard<std::mutex> l(timeline_mu_);
  timeline_ = std::move(t);
  return Status::OK();
}

void Runtime::StopTimeline() {
  std::shared_ptr<Timeline> old;
  {
    std::lock_guard<std::mutex> l(timeline_mu_);
    old.swap(timeline_);
  }
  // The loop may still hold a copy for its current round; the file is closed
  // when the last copy goes.
}

std::shared_ptr<Timeline> Runtime::CurrentTimeline() {
  std::lock_guard<std::mutex> l(timeline_mu_);
  return timeline_;
}

Runtime::Stats Runtime::stats() const {
  Stats s;
  s.allreduced_bytes = stat_bytes_.load();
  s.batches = stat_batches_.load();
  s.busy_seconds = stat_busy_ns_.load() * 1e-9;
  return s;
}

int64_t Runtime::BackendRuns(const char* name) const {
  for (size_t i = 0; i < backends_.size(); ++i) {
    if (std::strcmp(backends_[i]->Name(), name) == 0)
      return backend_runs_[i].load();
  }
  return 0;
}

std::string Runtime::BackendNames() const {
  std::string names;
  for (const auto& b : backends_)
    names += (names.empty() ? "" : ",") + std::string(b->Name());
  return names;
}

void Runtime::SetTunables(int64_t fusion_threshold, double cycle_time_ms,
                          bool cache) {
  tune_threshold_ = fusion_threshold;
  tune_cycle_ms_ = cycle_time_ms;
  tune_cache_ = cache;
}

void Runtime::GetTunables(int64_t* fusion_threshold, double* cycle_time_ms,
                          bool* cache) const {
  *fusion_threshold = tune_threshold_.load();
  *cycle_time_ms = tune_cycle_ms_.load();
  *cache = tune_cache_.load();
}

void Runtime::RecordBatch(const std::vector<const Response*>& resps,
                          const char* phase, Clock::time_point start,
                          Clock::time_point end, const std::string& args) {
  if (!loop_timeline_) return;
  std::vector<const std::string*> names;
  names.reserve(resps.size());
  for (const Response* r : resps) names.push_back(&r->req.name);
  loop_timeline_->Phases(names, phase, start, end, args);
}

Status Runtime::stopped_status() {
  std::lock_guard<std::mutex> l(mu_);
  return stopped_ ? stopped_status_ : Status::OK();
}

std::string Runtime::Labelled(const std::string& message) const {
  return role_.label.empty() ? message : role_.label + ": " + message;
}

Status Runtime::Enqueue(Entry entry) {
  std::vector<Entry> one;
  one.push_back(std::move(entry));
  size_t queued = 0;
  return EnqueueMany(one, &queued);
}

Status Runtime::EnqueueMany(std::vector<Entry>& entries, size_t* queued) {
  *queued = 0;
  Status failed;
  size_t valid = entries.size();
  for (size_t i = 0; i < entries.size(); ++i) {
    failed = PrepareRequest(entries[i].req, topology().size,
                            RegisteredDeviceBackend().factory != nullptr);
    if (!failed.ok()) {
      valid = i;
      break;
    }
  }
  if (!failed.ok() && !role_.label.empty())
    failed = Status(failed.code(), Labelled(failed.message()));
  // A bad request is reported as such, even if the runtime has stopped
  // meanwhile (another rank's shutdown must not hide the caller's mistake).
  if (valid == 0) return failed;
  std::lock_guard<std::mutex> l(mu_);
  if (stopped_ || shutdown_requested_) {
    // After a lost rank: the same error as the collectives that failed.
    const StatusCode code = stopped_status_.code() == StatusCode::kRanksLost
                                ? StatusCode::kRanksLost
                                : StatusCode::kAborted;
    return Status(code,
                  Labelled("kerasdist has shut down") +
                      (stopped_status_.message().empty()
                           ? std::string(".")
                           : ": " + stopped_status_.message()) +
                      " Call kerasdist.init() again to start a new runtime.");
  }
  for (size_t i = 0; i < valid; ++i) {
    const std::string& name = entries[i].req.name;
    if (!in_flight_.insert(name).second) {
      failed = Status::InvalidArgument(
          "a collective named '" + name +
          "' is already in flight on this rank; "
          "names must be unique among concurrent collectives.");
      break;
    }
    incoming_.push_back(std::move(entries[i]));
    ++*queued;
  }
  // One wake-up for the lot: the thread then sees a whole group at once.
  if (*queued > 0) cv_.notify_one();
  return failed;
}

void Runtime::Shutdown() {
  {
    std::lock_guard<std::mutex> l(mu_);
    shutdown_requested_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  // After the loop's goodbyes: a rank that has said them is done, and the
  // others must not count it as lost when its process ends.
  if (liveness_) liveness_->Stop();
}

// ---- The loop ---------------------------------------------------------------

void Runtime::Loop() {
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // precise short sleeps
  prctl(PR_SET_NAME, "kerasdist", 0, 0, 0);   // its name in top -H and perf
  int idle_rounds = 0;
  while (true) {
    if (role_.parent && role_.parent->has_stopped()) {
      FailWithParent();
      break;
    }
    bool worked = RunLoopOnce();
    worked = PollBackends() || worked;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (stopped_) break;
    }
    if (worked) {
      idle_rounds = 0;
      last_work_ = Clock::now();
    } else if (!async_.empty()) {
      std::this_thread::yield();  // completion latency over a spare core
    } else {
      IdleWait(idle_rounds++, !pending_.empty());
    }
  }
  if (stopped_status().code() == StatusCode::kRanksLost) {
    // No goodbyes: a lost rank never answers. The job's runtime re-forms
    // the job among the survivors before Shutdown returns.
    if (!role_.parent) transport_->Reform(ReformDeadlineS(config_));
    return;
  }
  SayGoodbye();
  transport_->FlushSends(5.0);
}

// A process set's runtime whose job's runtime stopped: its collectives fail.
// After a lost rank (recovery in place) with the job's error, RanksLost, so
// that kerasdist.elastic recovers from a set's collective as from the job's,
// and its communicator is revoked, so that no other member stays inside an
// MPI call on it waiting for the lost rank (or for this one).
void Runtime::FailWithParent() {
  const Status parent = role_.parent->stopped_status();
  const std::string why =
      parent.message().empty() ? std::string(".") : ": " + parent.message();
  if (parent.code() == StatusCode::kRanksLost) {
    transport_->Revoke();
    FailAll(
        Status(StatusCode::kRanksLost, Labelled("the job lost a rank" + why)));
    return;
  }
  FailAll(Status::Aborted(Labelled("the job's runtime stopped" + why)));
}

// Every control message must be received before MPI finalizes, or MPI warns
// about unmatched messages at exit (UCX: "unexpected tag-receive descriptor
// ... was not matched": seen on rank 0 when other ranks' shutdown requests
// crossed its decision). So a worker that never asked for the shutdown sends
// its request now, as its last message, and rank 0 receives until every
// worker's last message has come, within a bound.
void Runtime::SayGoodbye() {
  const Topology& topo = topology();
  if (topo.rank != 0) {
    if (sent_shutdown_) return;
    RankMessage bye;
    bye.shutdown = true;
    sent_shutdown_ = true;
    // Best effort: the job is ending, and a failure here changes nothing.
    (void)transport_->SendControl(0, Serialize(bye));
    return;
  }
  said_goodbye_.resize(topo.size, false);
  int missing = 0;
  for (int r = 1; r < topo.size; ++r) missing += said_goodbye_[r] ? 0 : 1;
  const Clock::time_point until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(kGoodbyeTimeoutS));
  while (missing > 0 && Clock::now() < until) {
    bool got = false;
    int src = 0;
    std::string bytes;
    RankMessage m;
    if (!transport_->PollControl(&got, &src, &bytes).ok()) return;
    if (!got) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else if (Deserialize(bytes, &m).ok() && m.shutdown &&
               !said_goodbye_[src]) {
      said_goodbye_[src] = true;
      --missing;
    }
  }
}

void Runtime::IdleWait(int idle_rounds, bool have_pending) {
  const Clock::duration since = Clock::now() - last_work_;
  if (since < kSpin ||
      (have_pending && spin_while_pending_ && since < kPendingSpin)) {
    std::this_thread::yield();
    return;
  }
  int64_t cap = have_pending ? kMaxSleepPendingUs : kMaxSleepIdleUs;
  int64_t us = std::min<int64_t>(cap, int64_t{10} << std::min(idle_rounds, 10));
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait_for(l, std::chrono::microseconds(us),
               [&] { return !incoming_.empty() || shutdown_requested_; });
}

// One round: what this rank queued goes to the coordinator (rank 0 is the
// coordinator itself), and whatever was decided runs. Returns whether
// anything happened.
bool Runtime::RunLoopOnce() {
  if (topology().rank == 0) {
    loop_timeline_ = CurrentTimeline();
    coordinator_->set_record(loop_timeline_ != nullptr);
    if (!loop_timeline_) ready_at_.clear();
  }
  RankMessage msg;
  bool worked = TakeIncoming(&msg);
  Status s = topology().rank == 0 ? CoordinatorRound(msg, &worked)
                                  : WorkerRound(msg, &worked);
  if (s.ok()) s = transport_->ProgressSends();
  if (!s.ok()) {
    std::string why = s.message();
    if (s.code() == StatusCode::kRanksLost) {
      RevokeJob();
      // In the words every RanksLost message has, whatever the transport
      // said (kerasdist.elastic knows a TensorFlow op's error by them).
      if (why.rfind(kRanksLostText, 0) != 0) {
        why = std::string(kRanksLostText) + " (" + why + ")";
      }
    }
    FailAll(Status(s.code(),
                   "rank " + std::to_string(topology().rank) + ": " + why));
    return true;
  }
  return worked;
}

// A lost rank found by this runtime's round (the job's or a process
// set's): its communicators and the job's are revoked before the callers
// hear of it (Reform revokes again, for the heartbeat's losses), so that
// this rank's recovery (its job runtime's shutdown) can send nothing more
// on them and every rank's job runtime fails with RanksLost and re-forms.
// Otherwise a set member's shutdown request could reach the coordinator
// before the loss did, which would end the job ("rank N shut down").
void Runtime::RevokeJob() {
  transport_->Revoke();
  if (role_.parent) role_.parent->transport_->Revoke();
}

// Moves the front ends' new entries to pending_ and describes them for the
// coordinator: a cache index where the request equals a cached one, else the
// request. Also asks for shutdown once, when a shutdown was requested.
bool Runtime::TakeIncoming(RankMessage* msg) {
  std::vector<Entry> fresh;
  bool want_shutdown;
  {
    std::lock_guard<std::mutex> l(mu_);
    fresh.swap(incoming_);
    want_shutdown = shutdown_requested_;
  }
  const Topology& topo = topology();
  for (Entry& e : fresh) {
    if (e.req.op == OpType::kJoin) joined_ = true;
    int ci = e.req.op == OpType::kJoin
                 ? -1
                 : cache_->Lookup(e.req, topo.rank, topo.size);
    if (ci >= 0) {
      msg->cached.push_back(ci);
    } else {
      msg->requests.push_back(e.req);
    }
    std::string name = e.req.name;
    pending_.emplace(std::move(name), std::move(e));
  }
  if (want_shutdown && !sent_shutdown_) {
    msg->shutdown = true;
    sent_shutdown_ = true;
    shutdown_sent_at_ = Clock::now();
  }
  return !fresh.empty() || msg->shutdown;
}

// Rank 0: gathers every rank's news, checks for stalls, and once tensors
// are ready on every rank (and the batching window has passed) decides,
// tells the workers and runs the decision itself.
Status Runtime::CoordinatorRound(const RankMessage& mine, bool* worked) {
  if (*worked) coordinator_->Add(0, mine, *cache_);
  KD_RETURN_IF_ERROR(ReceiveFromWorkers(worked));
  const Clock::time_point now = Clock::now();
  bool stopped = false;
  KD_RETURN_IF_ERROR(CheckStalls(now, &stopped));
  if (stopped) {
    *worked = true;
    return Status::OK();
  }
  if (!coordinator_->HasReady()) return Status::OK();
  // Holding for fusion counts as work: the loop keeps polling meanwhile.
  *worked = true;
  if (HoldForFusion(now)) return Status::OK();
  return DecideAndRun(now);
}

Status Runtime::ReceiveFromWorkers(bool* worked) {
  while (true) {
    bool got = false;
    int src = 0;
    std::string bytes;
    KD_RETURN_IF_ERROR(transport_->PollControl(&got, &src, &bytes));
    if (!got) return Status::OK();
    RankMessage m;
    KD_RETURN_IF_ERROR(Deserialize(bytes, &m));
    coordinator_->Add(src, m, *cache_);
    if (m.shutdown) {
      said_goodbye_.resize(topology().size, false);
      said_goodbye_[src] = true;
    }
    *worked = true;
  }
}

// Once a second: warn about tensors some ranks submitted and others did not,
// and shut the job down past the stall limit or in a certain deadlock
// (*stopped).
Status Runtime::CheckStalls(Clock::time_point now, bool* stopped) {
  if (now - last_stall_check_ <= std::chrono::seconds(1)) return Status::OK();
  last_stall_check_ = now;
  StallReport report = coordinator_->CheckStalls(now);
  const std::string prefix = "kerasdist: ";
  for (const auto& w : report.warnings) {
    std::string line = w;
    if (!role_.label.empty() && line.rfind(prefix, 0) == 0)
      line = prefix + Labelled(line.substr(prefix.size()));
    if (config_.log_level > 0) std::fprintf(stderr, "%s\n", line.c_str());
  }
  if (report.shutdown_reason.empty()) return Status::OK();
  report.shutdown_reason = Labelled(report.shutdown_reason);
  if (report.deadlock && config_.log_level > 0)
    std::fprintf(stderr, "kerasdist: %s.\n", report.shutdown_reason.c_str());
  CoordinatorMessage out;
  out.shutdown = true;
  out.shutdown_reason = report.shutdown_reason;
  const std::string bytes = Serialize(out);
  for (int r = 1; r < topology().size; ++r) {
    KD_RETURN_IF_ERROR(transport_->SendControl(r, bytes));
  }
  *stopped = true;
  return Execute(out);
}

// The batching window: give more tensors of the same step a moment to become
// ready so that they share one fusion buffer.
bool Runtime::HoldForFusion(Clock::time_point now) {
  const double cycle_ms = tune_cycle_ms_.load();
  if (cycle_ms <= 0 || sent_shutdown_) {
    ready_waiting_ = false;
    return false;
  }
  if (!ready_waiting_) {
    ready_waiting_ = true;
    first_ready_ = now;
  }
  if (now - first_ready_ <
      std::chrono::duration<double, std::milli>(cycle_ms)) {
    return true;
  }
  ready_waiting_ = false;
  return false;
}

Status Runtime::DecideAndRun(Clock::time_point now) {
  coordinator_->set_fusion_threshold(tune_threshold_.load());
  coordinator_->set_cache_enabled(tune_cache_.load());
  CoordinatorMessage out = coordinator_->Decide(*cache_);
  if (loop_timeline_) {
    if (loop_timeline_->mark_cycles()) loop_timeline_->Cycle(now);
    for (ReadyInfo& info : coordinator_->TakeReadyInfo()) {
      std::string wait;
      for (int64_t w : info.wait_us)
        wait += (wait.empty() ? "" : ",") + std::to_string(w);
      loop_timeline_->Phase(
          info.name, kNegotiatePhase, info.first, info.last,
          "\"first_rank\":" + std::to_string(info.first_rank) +
              ",\"last_rank\":" + std::to_string(info.last_rank) +
              ",\"wait_us\":[" + wait + "]");
      ready_at_[info.name] = info.last;
    }
  }
  const std::string bytes = Serialize(out);
  for (int r = 1; r < topology().size; ++r) {
    KD_RETURN_IF_ERROR(transport_->SendControl(r, bytes));
  }
  return Execute(out);
}

// Ranks other than 0: send this rank's news, run every decision that came,
// and give up on a shutdown rank 0 never answers.
Status Runtime::WorkerRound(const RankMessage& mine, bool* worked) {
  if (*worked) KD_RETURN_IF_ERROR(transport_->SendControl(0, Serialize(mine)));
  while (true) {
    bool got = false;
    int src = 0;
    std::string bytes;
    KD_RETURN_IF_ERROR(transport_->PollControl(&got, &src, &bytes));
    if (!got) break;
    CoordinatorMessage out;
    KD_RETURN_IF_ERROR(Deserialize(bytes, &out));
    KD_RETURN_IF_ERROR(Execute(out));
    *worked = true;
    std::lock_guard<std::mutex> l(mu_);
    if (stopped_) break;
  }
  if (sent_shutdown_ &&
      Clock::now() - shutdown_sent_at_ >
          std::chrono::duration<double>(kShutdownReplyTimeoutS)) {
    return Status::Aborted(
        "rank 0 did not answer this rank's shutdown within " +
        std::to_string(static_cast<int>(kShutdownReplyTimeoutS)) +
        " s; it may be stuck or gone.");
  }
  return Status::OK();
}

// ---- Executing decisions ----------------------------------------------------

Status Runtime::Execute(const CoordinatorMessage& msg) {
  for (const Batch& b : msg.batches) {
    std::vector<const Response*> resps;
    for (size_t i = 0; i < b.cache_index.size(); ++i) {
      resps.push_back(b.cache_index[i] >= 0 ? &cache_->Get(b.cache_index[i])
                                            : &b.responses[i]);
    }
    Status s = ExecuteBatch(resps);
    for (size_t i = 0; i < b.cache_index.size(); ++i) {
      if (b.cache_index[i] < 0) cache_->Put(b.responses[i]);
    }
    KD_RETURN_IF_ERROR(s);
  }
  if (msg.shutdown) FailAll(Status::Aborted(msg.shutdown_reason + "."));
  return Status::OK();
}

// Runs one scheduled batch and completes its entries (or, on an asynchronous
// backend, leaves them to PollBackends). A failed collective fails its
// entries only; kInternal (MPI, NCCL, a kerasdist bug) is returned, and stops
// the runtime, since it may have hit some ranks only.
Status Runtime::ExecuteBatch(const std::vector<const Response*>& resps) {
  std::vector<Entry> entries;
  KD_RETURN_IF_ERROR(TakeEntries(resps, &entries));
  const Clock::time_point start = Clock::now();
  RecordQueued(resps, start);
  const Response& head = *resps[0];
  if (!head.error.empty()) {
    CompleteAll(entries, Result{Status::Mismatch(Labelled(head.error)), {}});
    return Status::OK();
  }
  if (head.req.op == OpType::kJoin) {
    // Every rank has joined: each join returns the last rank to join.
    joined_ = false;
    for (Entry& e : entries) {
      if (e.output != nullptr)
        *static_cast<int32_t*>(e.output) = head.req.root_rank;
    }
    CompleteAll(entries, Result{});
    return Status::OK();
  }
  CollectiveBatch batch;
  Result result;
  Status s = PrepareBatch(head, entries, &batch, &result);
  if (s.ok()) s = RunBatch(resps, entries, batch, result);
  if (!s.ok()) CompleteAll(entries, Result{s, {}});
  return s.code() == StatusCode::kInternal || s.code() == StatusCode::kRanksLost
             ? s
             : Status::OK();
}

// A joined rank's part in an allreduce it never submitted: zeros of the
// response's shape and dtype, in memory the entry owns.
Entry Runtime::ZeroEntry(const Response& r) {
  Entry z;
  z.req = RequestForRank(r, topology().rank, topology().size);
  const int64_t bytes = NumElements(z.req.shape) * DataTypeSize(z.req.dtype);
  auto buf = std::make_shared<std::vector<char>>(
      static_cast<size_t>(std::max<int64_t>(bytes, 1)), 0);
  z.input = buf->data();
  z.output = buf->data();
  z.done = [buf](const Result&) {};
  return z;
}

Status Runtime::TakeEntries(const std::vector<const Response*>& resps,
                            std::vector<Entry>* entries) {
  for (const Response* r : resps) {
    auto it = pending_.find(r->req.name);
    if (it == pending_.end() && joined_ && !r->error.empty()) {
      continue;  // the ranks that submitted it see the error
    }
    if (it == pending_.end() && joined_ && r->req.op == OpType::kAllreduce) {
      entries->push_back(ZeroEntry(*r));
      continue;
    }
    if (it == pending_.end()) {
      return Status::Internal(
          "the coordinator scheduled '" + r->req.name +
          "', which this rank never submitted (kerasdist bug).");
    }
    entries->push_back(std::move(it->second));
    pending_.erase(it);
  }
  return Status::OK();
}

// What the backend needs from the negotiated batch: scaling (Average as Sum
// plus a postscale), layouts for the collectives whose sizes differ by rank,
// and outputs for those, allocated by the front end now that their shape is
// known.
Status Runtime::PrepareBatch(const Response& head, std::vector<Entry>& entries,
                             CollectiveBatch* b, Result* result) {
  const Request& q = entries[0].req;
  const Topology& topo = topology();
  b->op = q.op;
  b->dtype = q.dtype;
  b->root_rank = q.root_rank;
  b->device = q.device;
  b->prescale = q.prescale;
  const Scaling sc = AverageAsSum(q.reduce_op, q.dtype, q.postscale, topo.size);
  b->reduce_op = sc.op;
  b->postscale = sc.post;
  b->divisor = sc.divisor;
  b->tensors.reserve(entries.size());
  for (Entry& e : entries) {
    b->tensors.push_back({&e.req.name, e.input, e.output,
                          NumElements(e.req.shape), e.ready_event});
  }
  Layout l;
  switch (q.op) {
    case OpType::kAllgather:
      l = AllgatherLayout(head, q);
      break;
    case OpType::kAlltoall:
      l = AlltoallLayout(head, q, topo.rank, topo.size);
      break;
    case OpType::kReducescatter:
      l = ReducescatterLayout(q, topo.rank, topo.size);
      break;
    default:
      return Status::OK();  // outputs preallocated
  }
  KD_RETURN_IF_ERROR(entries[0].allocate(l.out_shape, &b->tensors[0].output));
  b->send_bytes = std::move(l.send_bytes);
  b->recv_bytes = std::move(l.recv_bytes);
  b->counts = std::move(l.counts);
  result->recv_splits = std::move(l.recv_splits);
  return Status::OK();
}

// The first enabled backend runs the batch. A synchronous one has finished
// when Run returns; an asynchronous one's batch waits in async_ for Poll.
Status Runtime::RunBatch(const std::vector<const Response*>& resps,
                         std::vector<Entry>& entries, CollectiveBatch& b,
                         Result& result) {
  Backend* backend = ChooseBackend(backends_, b);
  if (backend == nullptr) {
    return Status::Internal(std::string("no backend runs ") + OpTypeName(b.op) +
                            " on " + (b.device >= 0 ? "GPU" : "host") +
                            " memory (kerasdist bug).");
  }
  const uint64_t tag = next_tag_++;
  const Clock::time_point start = Clock::now();
  KD_RETURN_IF_ERROR(backend->Run(b, tag));
  CountRun(b, start);
  if (backend->Asynchronous()) {
    async_.emplace(tag, AsyncBatch{std::move(entries), std::move(result), start,
                                   b.backend, b.device});
    return Status::OK();
  }
  RecordRun(resps, b, start);
  CompleteAll(entries, result);
  return Status::OK();
}

void Runtime::CountRun(const CollectiveBatch& b, Clock::time_point start) {
  if (b.op == OpType::kAllreduce) stat_bytes_ += b.bytes();
  stat_batches_ += 1;
  if (b.device < 0) {
    stat_busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                         Clock::now() - start)
                         .count();
  }
  for (size_t i = 0; i < backends_.size(); ++i) {
    if (std::strcmp(backends_[i]->Name(), b.backend) == 0) {
      backend_runs_[i] += 1;
      return;
    }
  }
}

// Collects the batches asynchronous backends have finished.
bool Runtime::PollBackends() {
  if (async_.empty()) return false;
  std::vector<Completion> done;
  for (const auto& backend : backends_) {
    if (backend->Asynchronous() && backend->Busy()) backend->Poll(&done);
  }
  for (const Completion& c : done) {
    auto it = async_.find(c.tag);
    if (it == async_.end()) continue;
    AsyncBatch& a = it->second;
    a.result.status = c.status;
    RecordAsync(a);
    CompleteAll(a.entries, a.result);
    async_.erase(it);
    // A device failure (CUDA, NCCL) may have hit some ranks only: stop.
    if (c.status.code() == StatusCode::kInternal) {
      FailAll(Status(c.status.code(), "rank " +
                                          std::to_string(topology().rank) +
                                          ": " + c.status.message()));
      break;
    }
  }
  return !done.empty();
}

// ---- Timeline ---------------------------------------------------------------

void Runtime::RecordQueued(const std::vector<const Response*>& resps,
                           Clock::time_point start) {
  if (!loop_timeline_) return;
  for (const Response* r : resps) {
    auto it = ready_at_.find(r->req.name);
    if (it == ready_at_.end()) continue;
    loop_timeline_->Phase(r->req.name, kQueuePhase, it->second, start);
    ready_at_.erase(it);
  }
}

// A fused batch shows three phases (copy in, the collective, copy out), as
// marked by the backend; anything else one phase named after the collective.
void Runtime::RecordRun(const std::vector<const Response*>& resps,
                        const CollectiveBatch& b, Clock::time_point start) {
  if (!loop_timeline_) return;
  const Clock::time_point end = Clock::now();
  const char* phase = OpPhaseName(b.op);
  if (b.packed == Clock::time_point{}) {
    RecordBatch(resps, phase, start, end, BatchArgs(b));
    return;
  }
  if (b.phases != nullptr) {
    RecordBatch(resps, b.phases[0], start, b.packed, "");
    RecordBatch(resps, b.phases[1], b.packed, b.reduced, BatchArgs(b));
    RecordBatch(resps, b.phases[2], b.reduced, end, "");
    return;
  }
  RecordBatch(resps, kCopyInPhase, start, b.packed, "");
  RecordBatch(resps, phase, b.packed, b.reduced, BatchArgs(b));
  RecordBatch(resps, kCopyOutPhase, b.reduced, end, "");
}

// One phase per tensor, from the batch's issue on the communication stream
// to its completion as this thread saw it (fusion copies, the collective and
// the scaling all run on the device inside it).
void Runtime::RecordAsync(const AsyncBatch& a) {
  if (!loop_timeline_) return;
  const Clock::time_point now = Clock::now();
  for (const Entry& e : a.entries) {
    loop_timeline_->Phase(e.req.name, OpPhaseName(e.req.op), a.issued, now,
                          "\"device\":" + std::to_string(a.device) +
                              ",\"backend\":\"" + a.backend + "\",\"bytes\":" +
                              std::to_string(NumElements(e.req.shape) *
                                             DataTypeSize(e.req.dtype)));
  }
}

// ---- Completion -------------------------------------------------------------

void Runtime::Complete(Entry& e, const Result& r) {
  {
    std::lock_guard<std::mutex> l(mu_);
    in_flight_.erase(e.req.name);
  }
  if (e.done) e.done(r);
}

void Runtime::CompleteAll(std::vector<Entry>& entries, const Result& r) {
  {
    std::lock_guard<std::mutex> l(mu_);  // once for the batch
    for (const Entry& e : entries) in_flight_.erase(e.req.name);
  }
  for (Entry& e : entries) {
    if (e.done) e.done(r);
  }
}

void Runtime::FailAll(const Status& s) {
  std::vector<Entry> queued;
  {
    std::lock_guard<std::mutex> l(mu_);
    stopped_ = true;
    stopped_flag_ = true;
    if (stopped_status_.ok()) stopped_status_ = s;
    queued.swap(incoming_);
  }
  // Batches already on a GPU stream were issued on every rank; give them
  // time to finish before failing them.
  std::vector<Completion> done;
  for (const auto& backend : backends_) {
    if (backend->Asynchronous()) backend->Drain(10.0, s, &done);
  }
  for (const Completion& c : done) {
    auto it = async_.find(c.tag);
    if (it == async_.end()) continue;
    it->second.result.status = c.status;
    CompleteAll(it->second.entries, it->second.result);
    async_.erase(it);
  }
  for (auto& [tag, a] : async_) CompleteAll(a.entries, Result{s, {}});
  async_.clear();
  for (auto& [name, e] : pending_) Complete(e, Result{s, {}});
  pending_.clear();
  for (Entry& e : queued) Complete(e, Result{s, {}});
}

}  // namespace kerasdist::core
