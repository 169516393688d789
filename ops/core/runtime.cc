#include "runtime.h"

#include <sys/prctl.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "layout.h"
#include "scale.h"

namespace kerasdist::core {

namespace {

// How long the thread keeps polling after its last piece of work before it
// starts to sleep, and the longest sleep while this rank has tensors in flight
// or not. Spinning longer steals a core from TensorFlow (with 2 ranks on 2
// cores there is no spare one); sleeping longer adds latency.
constexpr auto kSpin = std::chrono::microseconds(60);
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
// The largest shared-memory slot per rank (see RunShmAllreduce).
constexpr int64_t kShmMaxSlotBytes = int64_t{64} << 20;

// The args of an allreduce's timeline event.
// `transport`: "shm" (slots), "cma" (peers read in place) or null (MPI).
std::string AllreduceArgs(int64_t bytes, size_t fused, DataType dt,
                          const char* transport) {
  return "\"bytes\":" + std::to_string(bytes) + ",\"fused\":" + std::to_string(fused) +
         ",\"dtype\":\"" + DataTypeName(dt) + "\"" +
         (transport ? std::string(",\"transport\":\"") + transport + "\"" : "");
}


}  // namespace

Status Runtime::Start(const Config& config, bool has_comm, int parent_comm_f,
                      std::unique_ptr<Runtime>* out) {
  std::unique_ptr<Runtime> rt(new Runtime());
  rt->config_ = config;
  KD_RETURN_IF_ERROR(MpiContext::Create(has_comm, parent_comm_f, &rt->mpi_));
  rt->host_ = rt->mpi_->MakeHostCommunicator();
  bool oversubscribed = false;
  KD_RETURN_IF_ERROR(NodeOversubscribed(rt->mpi_->comm(), &oversubscribed));
  rt->spin_while_pending_ = !oversubscribed;
  KD_RETURN_IF_ERROR(
      ShmAllreduce::Create(rt->mpi_->comm(), config.shm_allreduce,
                           config.shm_allreduce_min_bytes, &rt->shm_));
  if (rt->shm_) {
    KD_RETURN_IF_ERROR(CmaAllreduce::Create(rt->mpi_->comm(), config.cma_allreduce,
                                            config.cma_min_tensor_bytes,
                                            &rt->cma_));
  }
  rt->cache_ = std::make_unique<ResponseCache>(config.cache_capacity);
  if (rt->topology().rank == 0) {
    rt->coordinator_ = std::make_unique<Coordinator>(rt->topology().size, config);
  }
  rt->tune_threshold_ = config.fusion_threshold_bytes;
  rt->tune_cycle_ms_ = config.cycle_time_ms;
  rt->tune_cache_ = config.cache_capacity > 0;
  if (!config.timeline_path.empty()) {
    KD_RETURN_IF_ERROR(rt->StartTimeline(config.timeline_path,
                                         config.timeline_mark_cycles));
  }
  rt->last_stall_check_ = Clock::now();
  rt->last_work_ = Clock::now();
  rt->thread_ = std::thread(&Runtime::Loop, rt.get());
  *out = std::move(rt);
  return Status::OK();
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
  s.shm_allreduces = stat_shm_.load();
  s.cma_allreduces = stat_cma_.load();
  return s;
}

void Runtime::SetTunables(int64_t fusion_threshold, double cycle_time_ms, bool cache) {
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

void Runtime::RecordFusedBatch(const std::vector<const Response*>& resps,
                               Clock::time_point packed_from, Clock::time_point reduced_from,
                               Clock::time_point unpacked_from, const std::string& args) {
  const Clock::time_point end = Clock::now();
  RecordBatch(resps, "MEMCPY_IN_FUSION_BUFFER", packed_from, reduced_from, "");
  RecordBatch(resps, "ALLREDUCE", reduced_from, unpacked_from, args);
  RecordBatch(resps, "MEMCPY_OUT_FUSION_BUFFER", unpacked_from, end, "");
}

Status Runtime::stopped_status() {
  std::lock_guard<std::mutex> l(mu_);
  return stopped_ ? stopped_status_ : Status::OK();
}

Status Runtime::ValidateLocal(const Request& q) const {
  const int size = topology().size;
  // Spelled out only for an error: this runs for every tensor of every step.
  auto what = [&q] { return std::string(OpTypeName(q.op)) + " '" + q.name + "'"; };
  if (q.name.empty()) {
    return Status::InvalidArgument("every collective needs a name that is the "
                                   "same on all ranks; got an empty name.");
  }
  if ((q.op == OpType::kAllreduce || q.op == OpType::kReducescatter) &&
      q.dtype == DataType::kBool) {
    return Status::InvalidArgument(what() + ": bool tensors cannot be reduced; "
                                   "cast to int32 first.");
  }
  if (q.op == OpType::kBroadcast && (q.root_rank < 0 || q.root_rank >= size)) {
    return Status::InvalidArgument(what() + ": root_rank must be in [0, " +
                                   std::to_string(size) + "), got " +
                                   std::to_string(q.root_rank) + ".");
  }
  if ((q.op == OpType::kAllgather || q.op == OpType::kAlltoall ||
       q.op == OpType::kReducescatter) && q.shape.empty()) {
    return Status::InvalidArgument(what() + " needs a tensor of at least one "
                                   "dimension; got a scalar.");
  }
  for (int64_t d : q.shape) {
    if (d < 0) return Status::InvalidArgument(what() + ": negative dimension in " + ShapeString(q.shape) + ".");
  }
  if (!std::isfinite(q.prescale) || !std::isfinite(q.postscale)) {
    return Status::InvalidArgument(what() + ": scale factors must be finite.");
  }
  if (q.op == OpType::kAlltoall) {
    if (static_cast<int>(q.splits.size()) != size) {
      return Status::InvalidArgument(what() + ": splits must have one entry per rank (" +
                                     std::to_string(size) + "), got " +
                                     std::to_string(q.splits.size()) + ".");
    }
    int64_t sum = 0;
    for (int64_t s : q.splits) {
      if (s < 0) return Status::InvalidArgument(what() + ": splits must be >= 0, got " + ShapeString(q.splits) + ".");
      sum += s;
    }
    if (sum != q.shape[0]) {
      return Status::InvalidArgument(what() + ": splits " + ShapeString(q.splits) +
                                     " add up to " + std::to_string(sum) +
                                     " but the first dimension is " +
                                     std::to_string(q.shape[0]) + ".");
    }
  }
  if (q.device >= 0 && !RegisteredDeviceBackend().factory) {
    return Status::InvalidArgument(what() + ": the tensor is in GPU memory, but this "
                                   "kerasdist build has no GPU backend (rebuild "
                                   "with KERASDIST_WITH_NCCL=1).");
  }
  return Status::OK();
}

Status Runtime::Enqueue(Entry entry) {
  std::vector<Entry> one;
  one.push_back(std::move(entry));
  size_t queued = 0;
  return EnqueueMany(one, &queued);
}

Status Runtime::Prepare(Request& q) const {
  if (q.op == OpType::kAlltoall && q.splits.empty() && !q.shape.empty()) {
    const int size = topology().size;
    if (q.shape[0] % size != 0) {
      return Status::InvalidArgument(
          "alltoall '" + q.name + "': without splits the first dimension (" +
          std::to_string(q.shape[0]) + ") must be divisible by the number of ranks (" +
          std::to_string(size) + "); pass splits.");
    }
    q.splits.assign(size, q.shape[0] / size);
  }
  return ValidateLocal(q);
}

Status Runtime::EnqueueMany(std::vector<Entry>& entries, size_t* queued) {
  *queued = 0;
  Status failed;
  size_t valid = entries.size();
  for (size_t i = 0; i < entries.size(); ++i) {
    failed = Prepare(entries[i].req);
    if (!failed.ok()) {
      valid = i;
      break;
    }
  }
  // A bad request is reported as such, even if the runtime has stopped
  // meanwhile (another rank's shutdown must not hide the caller's mistake).
  if (valid == 0) return failed;
  std::lock_guard<std::mutex> l(mu_);
  if (stopped_ || shutdown_requested_) {
    return Status::Aborted(
        "kerasdist has shut down" +
        (stopped_status_.message().empty() ? std::string(".")
                                           : ": " + stopped_status_.message()) +
        " Call kerasdist.init() again to start a new runtime.");
  }
  for (size_t i = 0; i < valid; ++i) {
    const std::string& name = entries[i].req.name;
    if (!in_flight_.insert(name).second) {
      failed = Status::InvalidArgument(
          "a collective named '" + name + "' is already in flight on this rank; "
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
}

void Runtime::Loop() {
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // precise short sleeps
  prctl(PR_SET_NAME, "kerasdist", 0, 0, 0);   // its name in top -H and perf
  int idle_rounds = 0;
  while (true) {
    bool worked = RunLoopOnce();
    worked = PollDevice() || worked;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (stopped_) break;
    }
    if (worked) {
      idle_rounds = 0;
      last_work_ = Clock::now();
    } else if (device_ && device_->Busy()) {
      std::this_thread::yield();  // completion latency over a spare core
    } else {
      IdleWait(idle_rounds++, !pending_.empty());
    }
  }
  mpi_->FlushSends(5.0);
}

void Runtime::IdleWait(int idle_rounds, bool have_pending) {
  const Clock::duration since = Clock::now() - last_work_;
  if (since < kSpin || (have_pending && spin_while_pending_ && since < kPendingSpin)) {
    std::this_thread::yield();
    return;
  }
  int64_t cap = have_pending ? kMaxSleepPendingUs : kMaxSleepIdleUs;
  int64_t us = std::min<int64_t>(cap, int64_t{10} << std::min(idle_rounds, 10));
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait_for(l, std::chrono::microseconds(us),
               [&] { return !incoming_.empty() || shutdown_requested_; });
}

bool Runtime::RunLoopOnce() {
  const Topology& topo = topology();
  if (topo.rank == 0) {
    loop_timeline_ = CurrentTimeline();
    coordinator_->set_record(loop_timeline_ != nullptr);
    if (!loop_timeline_) ready_at_.clear();
  }
  std::vector<Entry> fresh;
  bool want_shutdown;
  {
    std::lock_guard<std::mutex> l(mu_);
    fresh.swap(incoming_);
    want_shutdown = shutdown_requested_;
  }
  RankMessage msg;
  for (Entry& e : fresh) {
    int ci = cache_->Lookup(e.req, topo.rank, topo.size);
    if (ci >= 0) {
      msg.cached.push_back(ci);
    } else {
      msg.requests.push_back(e.req);
    }
    std::string name = e.req.name;
    pending_.emplace(std::move(name), std::move(e));
  }
  if (want_shutdown && !sent_shutdown_) {
    msg.shutdown = true;
    sent_shutdown_ = true;
    shutdown_sent_at_ = Clock::now();
  }
  bool worked = !fresh.empty() || msg.shutdown;
  Status s;
  if (topo.rank == 0) {
    if (worked) coordinator_->Add(0, msg, *cache_);
    while (s.ok()) {
      bool got = false;
      int src = 0;
      std::string bytes;
      s = mpi_->PollControl(&got, &src, &bytes);
      if (!s.ok() || !got) break;
      RankMessage m;
      s = Deserialize(bytes, &m);
      if (s.ok()) coordinator_->Add(src, m, *cache_);
      worked = true;
    }
    Clock::time_point now = Clock::now();
    if (s.ok() && now - last_stall_check_ > std::chrono::seconds(1)) {
      last_stall_check_ = now;
      StallReport report = coordinator_->CheckStalls(now);
      for (const auto& w : report.warnings) {
        if (config_.log_level > 0) std::fprintf(stderr, "%s\n", w.c_str());
      }
      if (!report.shutdown_reason.empty()) {
        CoordinatorMessage out;
        out.shutdown = true;
        out.shutdown_reason = report.shutdown_reason;
        std::string bytes = Serialize(out);
        for (int r = 1; r < topo.size; ++r) mpi_->SendControl(r, bytes);
        s = Execute(out);
        return true;
      }
    }
    if (s.ok() && coordinator_->HasReady()) {
      // The batching window: give more tensors of the same step a moment to
      // become ready so that they share one fusion buffer.
      bool hold = false;
      const double cycle_ms = tune_cycle_ms_.load();
      if (cycle_ms > 0 && !sent_shutdown_) {
        if (!ready_waiting_) {
          ready_waiting_ = true;
          first_ready_ = now;
        }
        hold = now - first_ready_ <
               std::chrono::duration<double, std::milli>(cycle_ms);
      }
      if (hold) return true;
      ready_waiting_ = false;
      coordinator_->set_fusion_threshold(tune_threshold_.load());
      coordinator_->set_cache_enabled(tune_cache_.load());
      CoordinatorMessage out = coordinator_->Decide(*cache_);
      if (loop_timeline_) {
        if (loop_timeline_->mark_cycles()) loop_timeline_->Cycle(now);
        for (ReadyInfo& info : coordinator_->TakeReadyInfo()) {
          std::string wait;
          for (int64_t w : info.wait_us) wait += (wait.empty() ? "" : ",") + std::to_string(w);
          loop_timeline_->Phase(info.name, "NEGOTIATE", info.first, info.last,
                                "\"first_rank\":" + std::to_string(info.first_rank) +
                                    ",\"last_rank\":" + std::to_string(info.last_rank) +
                                    ",\"wait_us\":[" + wait + "]");
          ready_at_[info.name] = info.last;
        }
      }
      std::string bytes = Serialize(out);
      for (int r = 1; r < topo.size && s.ok(); ++r) s = mpi_->SendControl(r, bytes);
      if (s.ok()) s = Execute(out);
      worked = true;
    }
  } else {
    if (worked) s = mpi_->SendControl(0, Serialize(msg));
    while (s.ok()) {
      bool got = false;
      int src = 0;
      std::string bytes;
      s = mpi_->PollControl(&got, &src, &bytes);
      if (!s.ok() || !got) break;
      CoordinatorMessage out;
      s = Deserialize(bytes, &out);
      if (s.ok()) s = Execute(out);
      worked = true;
      std::lock_guard<std::mutex> l(mu_);
      if (stopped_) break;
    }
    if (s.ok() && sent_shutdown_ &&
        Clock::now() - shutdown_sent_at_ >
            std::chrono::duration<double>(kShutdownReplyTimeoutS)) {
      s = Status::Aborted("rank 0 did not answer this rank's shutdown within " +
                          std::to_string(static_cast<int>(kShutdownReplyTimeoutS)) +
                          " s; it may be stuck or gone.");
    }
  }
  if (s.ok()) s = mpi_->ProgressSends();
  if (!s.ok()) {
    FailAll(Status(s.code(), "rank " + std::to_string(topo.rank) + ": " + s.message()));
    return true;
  }
  return worked;
}

Status Runtime::Execute(const CoordinatorMessage& msg) {
  Status s;
  for (const Batch& b : msg.batches) {
    std::vector<const Response*> resps;
    for (size_t i = 0; i < b.cache_index.size(); ++i) {
      resps.push_back(b.cache_index[i] >= 0 ? &cache_->Get(b.cache_index[i])
                                            : &b.responses[i]);
    }
    s = ExecuteBatch(resps);
    for (size_t i = 0; i < b.cache_index.size(); ++i) {
      if (b.cache_index[i] < 0) cache_->Put(b.responses[i]);
    }
    if (!s.ok()) return s;
  }
  if (msg.shutdown) {
    FailAll(Status::Aborted(msg.shutdown_reason + "."));
  }
  return s;
}

Status Runtime::ExecuteBatch(const std::vector<const Response*>& resps) {
  std::vector<Entry> entries;
  for (const Response* r : resps) {
    auto it = pending_.find(r->req.name);
    if (it == pending_.end()) {
      return Status::Internal("the coordinator scheduled '" + r->req.name +
                              "', which this rank never submitted (kerasdist bug).");
    }
    entries.push_back(std::move(it->second));
    pending_.erase(it);
  }
  const Clock::time_point start = Clock::now();
  if (loop_timeline_) {
    for (const Response* r : resps) {
      auto it = ready_at_.find(r->req.name);
      if (it == ready_at_.end()) continue;
      loop_timeline_->Phase(r->req.name, "QUEUE", it->second, start);
      ready_at_.erase(it);
    }
  }
  const Response& head = *resps[0];
  if (!head.error.empty()) {
    for (Entry& e : entries) Complete(e, Result{Status::Mismatch(head.error), {}});
    return Status::OK();
  }
  if (head.req.device >= 0) return ExecuteDevice(resps, std::move(entries));
  if (head.req.op == OpType::kAllreduce) {
    std::vector<Entry*> ptrs;
    for (Entry& e : entries) ptrs.push_back(&e);
    Status s = RunAllreduce(resps, ptrs);
    int64_t bytes = 0;
    for (Entry& e : entries) bytes += NumElements(e.req.shape) * DataTypeSize(e.req.dtype);
    stat_bytes_ += bytes;
    stat_batches_ += 1;
    stat_busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                         Clock::now() - start).count();
    CompleteAll(entries, Result{s, {}});
    return s.code() == StatusCode::kInternal ? s : Status::OK();
  }
  Result result;
  result.status = RunOther(head, entries[0], &result);
  Status s = result.status;
  Clock::time_point end = Clock::now();
  stat_batches_ += 1;
  stat_busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
  if (loop_timeline_) {
    loop_timeline_->Phase(head.req.name, OpPhaseName(head.req.op), start, end,
                          "\"bytes\":" + std::to_string(NumElements(head.req.shape) *
                                                        DataTypeSize(head.req.dtype)) +
                              ",\"dtype\":\"" + DataTypeName(head.req.dtype) + "\"");
  }
  Complete(entries[0], result);
  return s.code() == StatusCode::kInternal ? s : Status::OK();
}

Status Runtime::RunAllreduce(const std::vector<const Response*>& resps,
                             std::vector<Entry*>& entries) {
  const Request& q = resps[0]->req;
  const Scaling sc = AverageAsSum(q.reduce_op, q.dtype, q.postscale, topology().size);
  const ReduceOp op = sc.op;
  const double post = sc.post;
  const int64_t divisor = sc.divisor;
  const int64_t esize = DataTypeSize(q.dtype);
  const Clock::time_point t0 = Clock::now();
  if (topology().size == 1) {
    // Every reduction over one rank is the identity: only the scale factors
    // apply (in two passes, rounding as the general path does), and an
    // in-place tensor with no scaling costs nothing at all.
    int64_t total = 0;
    for (Entry* e : entries) {
      const int64_t n = NumElements(e->req.shape);
      ScaleCopy(e->output, e->input, n, q.dtype, q.prescale);
      ScaleCopy(e->output, e->output, n, q.dtype, post, divisor);
      total += n;
    }
    if (loop_timeline_) {
      RecordBatch(resps, "ALLREDUCE", t0, Clock::now(),
                  AllreduceArgs(total * esize, entries.size(), q.dtype, nullptr));
    }
    return Status::OK();
  }
  bool ran = false;
  KD_RETURN_IF_ERROR(RunShmAllreduce(resps, entries, sc, &ran));
  if (ran) return Status::OK();
  if (entries.size() == 1) {
    Entry& e = *entries[0];
    int64_t n = NumElements(e.req.shape);
    if (q.prescale == 1.0) {
      // MPI reads the input and writes the output: no copy of our own.
      KD_RETURN_IF_ERROR(host_->AllreduceFrom(e.input, e.output, n, q.dtype, op));
    } else {
      ScaleCopy(e.output, e.input, n, q.dtype, q.prescale);
      KD_RETURN_IF_ERROR(host_->Allreduce(e.output, n, q.dtype, op));
    }
    ScaleCopy(e.output, e.output, n, q.dtype, post, divisor);
    if (loop_timeline_) {
      RecordBatch(resps, "ALLREDUCE", t0, Clock::now(),
                  AllreduceArgs(n * esize, 1, q.dtype, nullptr));
    }
    return Status::OK();
  }
  int64_t total = 0;
  for (Entry* e : entries) total += NumElements(e->req.shape);
  char* buf = fusion_buffer_.Reserve(total * esize);
  int64_t off = 0;
  for (Entry* e : entries) {
    int64_t n = NumElements(e->req.shape);
    ScaleCopy(buf + off * esize, e->input, n, q.dtype, q.prescale);
    off += n;
  }
  const Clock::time_point t1 = Clock::now();
  KD_RETURN_IF_ERROR(host_->Allreduce(buf, total, q.dtype, op));
  const Clock::time_point t2 = Clock::now();
  off = 0;
  for (Entry* e : entries) {
    int64_t n = NumElements(e->req.shape);
    ScaleCopy(e->output, buf + off * esize, n, q.dtype, post, divisor);
    off += n;
  }
  if (loop_timeline_) {
    RecordFusedBatch(resps, t0, t1, t2,
                     AllreduceArgs(total * esize, entries.size(), q.dtype, nullptr));
  }
  return Status::OK();
}

Status Runtime::RunShmAllreducePieces(const std::vector<const Response*>& resps,
                                      Entry& e, const Scaling& sc, bool* ran) {
  const Request& q = e.req;
  const int64_t esize = DataTypeSize(q.dtype);
  const int64_t n = NumElements(q.shape);
  const int64_t piece = kShmMaxSlotBytes / esize;
  const Clock::time_point t0 = Clock::now();
  for (int64_t first = 0; first < n; first += piece) {
    const int64_t m = std::min(piece, n - first);
    char* slot = nullptr;
    KD_RETURN_IF_ERROR(shm_->Begin(m * esize, &slot));
    if (slot == nullptr) {
      // Only the first piece can be refused (later ones are no larger), and
      // every rank gets the same answer: MPI does the whole tensor.
      if (first == 0) return Status::OK();
      return Status::Internal("shared-memory slot lost mid-tensor (kerasdist bug)");
    }
    ScaleCopy(slot, static_cast<const char*>(e.input) + first * esize, m, q.dtype,
              q.prescale);
    KD_RETURN_IF_ERROR(shm_->Reduce(m, q.dtype, sc.op));
    shm_->CopyOut(0, m, q.dtype, static_cast<char*>(e.output) + first * esize,
                  sc.post, sc.divisor);
  }
  *ran = true;
  stat_shm_ += 1;
  if (loop_timeline_) {
    RecordBatch(resps, "ALLREDUCE", t0, Clock::now(),
                AllreduceArgs(n * esize, 1, q.dtype, "shm"));
  }
  return Status::OK();
}

Status Runtime::RunShmAllreduce(const std::vector<const Response*>& resps,
                                std::vector<Entry*>& entries, const Scaling& sc,
                                bool* ran) {
  *ran = false;
  const Request& q = resps[0]->req;
  if (!shm_ || !ShmAllreduce::Supports(q.dtype, sc.op)) return Status::OK();
  const int64_t esize = DataTypeSize(q.dtype);
  int64_t total = 0;
  for (Entry* e : entries) total += NumElements(e->req.shape);
  // Smaller allreduces go to MPI: their cost is latency, and there the
  // barriers were no faster than MPI's small-message path (4 KiB: even;
  // 64 KiB: shared memory 10-20% faster). Every rank must decide alike, so
  // the minimum is agreed at init (ShmAllreduce::Create).
  if (total == 0 || total * esize < shm_->min_bytes()) return Status::OK();
  // In-place reads pin the peer's pages tensor by tensor: for a batch of
  // small tensors one copy through the slots is cheaper (512 x 1 KiB: 0.60
  // ms a step through the slots, 0.73 ms read in place; 128 x 16 KiB: 0.59
  // ms against 0.53 ms). Every rank sees the same sizes and the same agreed
  // minimum, so every rank picks the same path.
  if (cma_ && q.prescale == 1.0 &&
      (total * esize >= cma_->min_tensor_bytes() * static_cast<int64_t>(entries.size()) ||
       total * esize > kShmMaxSlotBytes)) {
    // Peers read in place: no staging copy and no size limit. (A prescale
    // applies to each contribution before the sum: the slots do that in
    // their copy-in.)
    const Clock::time_point t0 = Clock::now();
    std::vector<CmaAllreduce::Segment>& segs = cma_segs_;
    segs.clear();
    for (Entry* e : entries) {
      segs.push_back({e->input, e->output, NumElements(e->req.shape)});
    }
    Clock::time_point t1, t2;
    KD_RETURN_IF_ERROR(
        cma_->Allreduce(segs, q.dtype, sc.op, sc.post, sc.divisor, &t1, &t2));
    *ran = true;
    stat_shm_ += 1;
    stat_cma_ += 1;
    if (loop_timeline_) {
      RecordFusedBatch(resps, t0, t1, t2,
                       AllreduceArgs(total * esize, entries.size(), q.dtype, "cma"));
    }
    return Status::OK();
  }
  // Slots hold at most kShmMaxSlotBytes (they stay mapped for the job's
  // life): a bigger single tensor goes through in pieces, a bigger fused
  // batch (a fusion threshold above that) through MPI.
  if (total * esize > kShmMaxSlotBytes) {
    if (entries.size() != 1) return Status::OK();
    return RunShmAllreducePieces(resps, *entries[0], sc, ran);
  }
  const Clock::time_point t0 = Clock::now();
  char* slot = nullptr;
  KD_RETURN_IF_ERROR(shm_->Begin(total * esize, &slot));
  if (slot == nullptr) return Status::OK();
  int64_t off = 0;
  for (Entry* e : entries) {
    const int64_t n = NumElements(e->req.shape);
    ScaleCopy(slot + off * esize, e->input, n, q.dtype, q.prescale);
    off += n;
  }
  const Clock::time_point t1 = Clock::now();
  KD_RETURN_IF_ERROR(shm_->Reduce(total, q.dtype, sc.op));
  const Clock::time_point t2 = Clock::now();
  off = 0;
  for (Entry* e : entries) {
    const int64_t n = NumElements(e->req.shape);
    shm_->CopyOut(off, n, q.dtype, e->output, sc.post, sc.divisor);
    off += n;
  }
  *ran = true;
  stat_shm_ += 1;
  if (loop_timeline_) {
    RecordFusedBatch(resps, t0, t1, t2,
                     AllreduceArgs(total * esize, entries.size(), q.dtype, "shm"));
  }
  return Status::OK();
}

Status Runtime::RunOther(const Response& resp, Entry& e, Result* result) {
  const Topology& topo = topology();
  const Request& q = e.req;
  const int64_t esize = DataTypeSize(q.dtype);
  switch (q.op) {
    case OpType::kBroadcast: {
      int64_t bytes = NumElements(q.shape) * esize;
      if (topo.rank == q.root_rank && e.output != e.input && bytes > 0) {
        std::memcpy(e.output, e.input, bytes);
      }
      return host_->Broadcast(e.output, bytes, q.root_rank);
    }
    case OpType::kAllgather: {
      const Layout l = AllgatherLayout(resp, q);
      void* out = nullptr;
      KD_RETURN_IF_ERROR(e.allocate(l.out_shape, &out));
      return host_->Allgatherv(e.input, out, l.recv_bytes);
    }
    case OpType::kAlltoall: {
      Layout l = AlltoallLayout(resp, q, topo.rank, topo.size);
      void* out = nullptr;
      KD_RETURN_IF_ERROR(e.allocate(l.out_shape, &out));
      result->recv_splits = std::move(l.recv_splits);
      return host_->Alltoallv(e.input, l.send_bytes, out, l.recv_bytes);
    }
    case OpType::kReducescatter: {
      const Scaling sc = AverageAsSum(q.reduce_op, q.dtype, q.postscale, topo.size);
      const Layout l = ReducescatterLayout(q, topo.rank, topo.size);
      const std::vector<int64_t>& counts = l.counts;
      void* out = nullptr;
      KD_RETURN_IF_ERROR(e.allocate(l.out_shape, &out));
      const void* in = e.input;
      int64_t total = NumElements(q.shape);
      if (q.prescale != 1.0) {
        char* tmp = fusion_buffer_.Reserve(total * esize);
        ScaleCopy(tmp, e.input, total, q.dtype, q.prescale);
        in = tmp;
      }
      KD_RETURN_IF_ERROR(host_->ReduceScatter(in, out, counts, q.dtype, sc.op));
      ScaleCopy(out, out, counts[topo.rank], q.dtype, sc.post, sc.divisor);
      return Status::OK();
    }
    case OpType::kBarrier:
      return host_->Barrier();
    case OpType::kAllreduce:
      break;
  }
  return Status::Internal("unexpected operation (kerasdist bug)");
}

Status Runtime::ExecuteDevice(const std::vector<const Response*>& resps,
                              std::vector<Entry> entries) {
  const Request& q = resps[0]->req;
  Status s;
  if (!device_) {
    DeviceBackendOptions o;
    o.comm = mpi_->comm();
    o.rank = topology().rank;
    o.size = topology().size;
    o.device = entries[0].req.device;  // this rank's GPU (ranks may differ)
    o.host_staged = config_.gpu_operations == "MPI";
    o.host = host_.get();
    s = RegisteredDeviceBackend().factory(o, &device_);
  }
  if (!s.ok()) {
    device_.reset();
    for (Entry& e : entries) Complete(e, Result{s, {}});
    // Setup failures are agreed on by all ranks (the next device batch tries
    // again); a CUDA/NCCL failure may have hit some ranks only: stop.
    return s.code() == StatusCode::kInternal ? s : Status::OK();
  }
  if (q.op == OpType::kAllreduce) {
    for (Entry& e : entries) {
      stat_bytes_ += NumElements(e.req.shape) * DataTypeSize(e.req.dtype);
    }
  }
  stat_batches_ += 1;
  if (loop_timeline_) {
    const Clock::time_point now = Clock::now();
    for (Entry& e : entries) e.issued = now;
  }
  // Completion comes through PollDevice once the device has done the work.
  return device_->Execute(resps, std::move(entries));
}

bool Runtime::PollDevice() {
  if (!device_ || !device_->Busy()) return false;
  FinishedEntries finished;
  device_->Poll(&finished);
  if (loop_timeline_ && !finished.empty()) {
    // One phase per tensor, from the batch's issue on the communication
    // stream to its completion as this thread saw it (fusion copies, the
    // collective and the scaling all run on the device inside it).
    const Clock::time_point now = Clock::now();
    const std::string transport =
        config_.gpu_operations == "MPI" ? "mpi-staged" : "nccl";
    for (auto& [e, r] : finished) {
      if (e.issued == Clock::time_point{}) continue;
      loop_timeline_->Phase(
          e.req.name, OpPhaseName(e.req.op), e.issued, now,
          "\"device\":" + std::to_string(e.req.device) + ",\"transport\":\"" +
              transport + "\",\"bytes\":" +
              std::to_string(NumElements(e.req.shape) * DataTypeSize(e.req.dtype)));
    }
  }
  for (auto& [e, r] : finished) Complete(e, r);
  return !finished.empty();
}

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
    if (stopped_status_.ok()) stopped_status_ = s;
    queued.swap(incoming_);
  }
  if (device_) {
    // Batches already on the GPU stream were issued on every rank; give them
    // time to finish before failing them.
    FinishedEntries finished;
    device_->Drain(10.0, s, &finished);
    for (auto& [e, r] : finished) Complete(e, r);
  }
  for (auto& [name, e] : pending_) Complete(e, Result{s, {}});
  pending_.clear();
  for (Entry& e : queued) Complete(e, Result{s, {}});
}

}  // namespace kerasdist::core
