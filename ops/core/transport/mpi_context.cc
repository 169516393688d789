#include "mpi_context.h"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "../half_kernels.h"

namespace kerasdist::core {

namespace {

// Each init() gets its own control tag. MPI may hand a new communicator the
// context id of one freed at shutdown(); a negotiation message still in
// flight from the previous life (e.g. a shutdown notice that crossed the
// coordinator's) must not be read by the new one. init() and shutdown() are
// collective, so the generation is the same on every rank.
constexpr int kControlTagBase = 17;
int g_generation = 0;

bool g_we_initialized_mpi = false;

// A job that a platform started (kerasdist/rendezvous/): MPICH's PMI
// server is rank 0's rendezvous server, and this is this process's hello
// connection to it (_KERASDIST_PMI_WATCH_FD, set for MPI_Init), whose end
// closes when the server goes. -1 otherwise.
int g_pmi_watch_fd = -1;
int g_world_rank = -1;

void TakePmiWatch() {
  const char* text = std::getenv("_KERASDIST_PMI_WATCH_FD");
  if (text == nullptr || *text == '\0') return;
  char* end = nullptr;
  const long fd = std::strtol(text, &end, 10);
  struct stat st;
  if (*end != '\0' || fd < 0 || fd > INT_MAX ||
      fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return;
  }
  g_pmi_watch_fd = static_cast<int>(fd);
}

// Whether the rendezvous server has gone (its process ended, or was
// killed): MPI_Finalize's PMI barrier would then fail, and MPICH crashes
// there (SIGSEGV) rather than return an error.
bool PmiServerGone() {
  if (g_pmi_watch_fd < 0) return false;
  pollfd p{g_pmi_watch_fd, POLLIN, 0};
  if (poll(&p, 1, 0) != 1) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return true;
  char c;
  const ssize_t n = recv(g_pmi_watch_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
}

// ---- /dev/shm: MPICH's shared memory --------------------------------------
//
// MPI_Init maps a file in /dev/shm, about 1 MiB for each rank on the host,
// sized with ftruncate and touched at once: on a full /dev/shm (Docker's
// 64 MB default, filled by the segments of killed jobs) the process dies of
// SIGBUS with no word of why. So init checks the space first, and a SIGBUS
// during MPI_Init still says what it most likely is.

constexpr char kShmDir[] = "/dev/shm";
constexpr uint64_t kShmPerLocalRank = uint64_t{1} << 20;

// The ranks on this host, as the launcher or platform says (1 if none).
int LocalRanksFromEnvironment() {
  for (const char* name : {"MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                           "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"}) {
    const char* text = std::getenv(name);
    if (text == nullptr) continue;
    char* end = nullptr;
    const long n = std::strtol(text, &end, 10);
    if (end != text && *end == '\0' && n > 0 && n <= 65536)
      return static_cast<int>(n);
  }
  return 1;
}

std::string MiB(uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MiB", bytes / 1048576.0);
  return text;
}

std::string ShmAdvice() {
  return std::string("free space in ") + kShmDir +
         " (remove the mpich_shm_* files of jobs that have ended; `kerasdist "
         "run` removes those of its own failed attempts) or make it larger "
         "(Docker: --shm-size=1g; Kubernetes: an emptyDir with medium: "
         "Memory mounted at /dev/shm)";
}

char g_sigbus_line[1024];
struct sigaction g_previous_sigbus;

void SigbusInMpiInit(int) {
  ssize_t ignored = write(2, g_sigbus_line, std::strlen(g_sigbus_line));
  (void)ignored;
  // Dies of the signal as it would have: the faulting access runs again.
  signal(SIGBUS, SIG_DFL);
}

// An error when /dev/shm cannot hold MPICH's segment; else arms the SIGBUS
// line for MPI_Init (DisarmSigbus after it).
Status CheckSharedMemory() {
  struct statvfs vfs;
  if (statvfs(kShmDir, &vfs) != 0) return Status::OK();  // MPI's own affair
  const uint64_t free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  const uint64_t size = uint64_t{vfs.f_blocks} * vfs.f_frsize;
  const int local = LocalRanksFromEnvironment();
  const uint64_t need = kShmPerLocalRank * static_cast<uint64_t>(local);
  if (free_bytes < need) {
    return Status::Precondition(
        std::string(kShmDir) + " has " + MiB(free_bytes) + " free of " +
        MiB(size) + ", and MPI's shared memory for the " +
        std::to_string(local) + " rank(s) on this host needs about " +
        MiB(need) + " (MPI_Init would die of SIGBUS); " + ShmAdvice());
  }
  std::snprintf(g_sigbus_line, sizeof(g_sigbus_line),
                "kerasdist: SIGBUS in MPI_Init: MPI's shared memory in %s "
                "most likely ran out (%s free of %s before it); %s.\n",
                kShmDir, MiB(free_bytes).c_str(), MiB(size).c_str(),
                ShmAdvice().c_str());
  struct sigaction sa{};
  sa.sa_handler = SigbusInMpiInit;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous_sigbus);
  return Status::OK();
}

void DisarmSigbus() { sigaction(SIGBUS, &g_previous_sigbus, nullptr); }

bool g_skip_finalize = false;

// Why this rank ends without MPI_Finalize, or "" to finalize.
std::string WhyNotFinalize() {
  if (g_skip_finalize)
    return "kd.init() failed (its error above says why), so this rank ends "
           "without MPI_Finalize, which would wait for ranks that wait for "
           "it.";
  if (PmiServerGone())
    // The process's own exit status stands; MPI's finalize is skipped.
    return "the job's rendezvous server (rank 0's, on the coordinator's "
           "port) has gone, so MPI cannot finalize; this process ends "
           "without MPI_Finalize. Its work up to here is done; the server "
           "is killed only from outside the job (the OOM killer, a signal "
           "to its process), or after rank 0 ended 30 s before.";
  return "";
}

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // A rank that left the job (shrinking in place) ends without
  // MPI_Finalize: with ULFM on, Open MPI's finalize first agrees with every
  // live process of MPI_COMM_WORLD (a shrink and a barrier over it), so it
  // would wait for the ranks that stay to end. They no longer talk to it;
  // ULFM takes its end as a process gone, as after a lost rank.
  if (LeftJob()) return;
  const std::string why = WhyNotFinalize();
  if (why.empty()) {
    MPI_Finalize();
    return;
  }
  const std::string line =
      "kerasdist: rank " + std::to_string(g_world_rank) + ": " + why + "\n";
  std::fflush(nullptr);
  ssize_t ignored = write(2, line.data(), line.size());
  (void)ignored;
}

// ---- MPI has no float16 / bfloat16: reduction functions of our own -------

template <DataType kType, ReduceOp kOp>
void MpiReduce16(void* invec, void* inoutvec, int* len, MPI_Datatype*) {
  auto* io = static_cast<uint16_t*>(inoutvec);
  Reduce16(kType, kOp, static_cast<const uint16_t*>(invec), io, io, *len);
}

struct HalfOps {
  MPI_Op ops[2][4];  // [half, bfloat16][sum, min, max, prod]
  HalfOps() {
    constexpr DataType kH = DataType::kFloat16, kB = DataType::kBFloat16;
    MPI_Op_create(&MpiReduce16<kH, ReduceOp::kSum>, 1, &ops[0][0]);
    MPI_Op_create(&MpiReduce16<kH, ReduceOp::kMin>, 1, &ops[0][1]);
    MPI_Op_create(&MpiReduce16<kH, ReduceOp::kMax>, 1, &ops[0][2]);
    MPI_Op_create(&MpiReduce16<kH, ReduceOp::kProduct>, 1, &ops[0][3]);
    MPI_Op_create(&MpiReduce16<kB, ReduceOp::kSum>, 1, &ops[1][0]);
    MPI_Op_create(&MpiReduce16<kB, ReduceOp::kMin>, 1, &ops[1][1]);
    MPI_Op_create(&MpiReduce16<kB, ReduceOp::kMax>, 1, &ops[1][2]);
    MPI_Op_create(&MpiReduce16<kB, ReduceOp::kProduct>, 1, &ops[1][3]);
  }
  ~HalfOps() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& row : ops)
      for (auto& op : row) MPI_Op_free(&op);
  }
};

int OpIndex(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return 1;
    case ReduceOp::kMax:
      return 2;
    case ReduceOp::kProduct:
      return 3;
    default:
      return 0;
  }
}

MPI_Datatype MpiType(DataType dt) {
  switch (dt) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return MPI_UINT16_T;
    case DataType::kFloat32:
      return MPI_FLOAT;
    case DataType::kFloat64:
      return MPI_DOUBLE;
    case DataType::kInt32:
      return MPI_INT32_T;
    case DataType::kInt64:
      return MPI_INT64_T;
    case DataType::kUInt8:
    case DataType::kBool:
      return MPI_UINT8_T;
    case DataType::kInt8:
      return MPI_INT8_T;
    case DataType::kInt16:
      return MPI_INT16_T;
    case DataType::kUInt16:
      return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

MPI_Op MpiOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kProduct:
      return MPI_PROD;
    default:
      return MPI_SUM;
  }
}

Status CheckCount(int64_t n, const char* what) {
  if (n > INT_MAX) {
    return Status::InvalidArgument(
        std::string(what) + " of " + std::to_string(n) +
        " exceeds MPI's int count limit; split the tensor.");
  }
  return Status::OK();
}

// Point-to-point messages (SendRecv, the Adasum tree) on a communicator:
// above the control plane's tags on the runtime's (kControlTagBase +
// generation % 16384, 17 to 16400).
constexpr int kSendRecvTag = 0x4164;

class MpiCommunicator : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_rank(comm, &rank_);
    MPI_Comm_size(comm, &size_);
  }
  std::string Name() const override { return "MPI"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status Allreduce(void* buf, int64_t count, DataType dt,
                   ReduceOp op) override {
    if (count == 0) return Status::OK();
    KD_RETURN_IF_ERROR(CheckCount(count, "allreduce element count"));
    return MpiStatus(MPI_Allreduce(MPI_IN_PLACE, buf, static_cast<int>(count),
                                   MpiType(dt), Op(dt, op), comm_),
                     "MPI_Allreduce");
  }

  Status AllreduceFrom(const void* in, void* out, int64_t count, DataType dt,
                       ReduceOp op) override {
    if (count == 0) return Status::OK();
    KD_RETURN_IF_ERROR(CheckCount(count, "allreduce element count"));
    return MpiStatus(
        MPI_Allreduce(in == out ? MPI_IN_PLACE : in, out,
                      static_cast<int>(count), MpiType(dt), Op(dt, op), comm_),
        "MPI_Allreduce");
  }

  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes) override {
    std::vector<int> counts, displs;
    KD_RETURN_IF_ERROR(Layout(bytes, &counts, &displs));
    return MpiStatus(
        MPI_Allgatherv(in, counts[rank_], MPI_BYTE, out, counts.data(),
                       displs.data(), MPI_BYTE, comm_),
        "MPI_Allgatherv");
  }

  Status Allgather(const void* in, void* out, int64_t bytes) override {
    KD_RETURN_IF_ERROR(CheckCount(bytes * size_, "message size"));
    return MpiStatus(MPI_Allgather(in, static_cast<int>(bytes), MPI_BYTE, out,
                                   static_cast<int>(bytes), MPI_BYTE, comm_),
                     "MPI_Allgather");
  }

  Status Gatherv(const void* in, void* out, const std::vector<int64_t>& bytes,
                 int root) override {
    std::vector<int> counts, displs;
    KD_RETURN_IF_ERROR(Layout(bytes, &counts, &displs));
    return MpiStatus(
        MPI_Gatherv(in, counts[rank_], MPI_BYTE, out, counts.data(),
                    displs.data(), MPI_BYTE, root, comm_),
        "MPI_Gatherv");
  }

  Status Broadcast(void* buf, int64_t bytes, int root) override {
    if (bytes == 0) return Status::OK();
    KD_RETURN_IF_ERROR(CheckCount(bytes, "broadcast size"));
    return MpiStatus(
        MPI_Bcast(buf, static_cast<int>(bytes), MPI_BYTE, root, comm_),
        "MPI_Bcast");
  }

  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes) override {
    std::vector<int> sc, sd, rc, rd;
    KD_RETURN_IF_ERROR(Layout(send_bytes, &sc, &sd));
    KD_RETURN_IF_ERROR(Layout(recv_bytes, &rc, &rd));
    return MpiStatus(MPI_Alltoallv(in, sc.data(), sd.data(), MPI_BYTE, out,
                                   rc.data(), rd.data(), MPI_BYTE, comm_),
                     "MPI_Alltoallv");
  }

  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dt,
                       ReduceOp op) override {
    std::vector<int> c;
    int64_t total = 0;
    for (int64_t x : counts) {
      c.push_back(static_cast<int>(x));
      total += x;
    }
    KD_RETURN_IF_ERROR(CheckCount(total, "reducescatter element count"));
    if (total == 0) return Status::OK();
    return MpiStatus(
        MPI_Reduce_scatter(in, out, c.data(), MpiType(dt), Op(dt, op), comm_),
        "MPI_Reduce_scatter");
  }

  Status Barrier() override {
    return MpiStatus(MPI_Barrier(comm_), "MPI_Barrier");
  }

  // In pieces an int can count.
  Status SendRecv(const void* send, int64_t send_bytes, int dest, void* recv,
                  int64_t recv_bytes, int source) override {
    constexpr int64_t kPiece = int64_t{1} << 30;
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    for (int64_t off = 0; off < send_bytes || off < recv_bytes; off += kPiece) {
      const int sn = static_cast<int>(
          std::max<int64_t>(0, std::min(kPiece, send_bytes - off)));
      const int rn = static_cast<int>(
          std::max<int64_t>(0, std::min(kPiece, recv_bytes - off)));
      KD_RETURN_IF_ERROR(MpiStatus(
          MPI_Sendrecv(s + (sn ? off : 0), sn, MPI_BYTE, dest, kSendRecvTag,
                       r + (rn ? off : 0), rn, MPI_BYTE, source, kSendRecvTag,
                       comm_, MPI_STATUS_IGNORE),
          "MPI_Sendrecv"));
    }
    return Status::OK();
  }

 private:
  MPI_Op Op(DataType dt, ReduceOp op) {
    if (dt == DataType::kFloat16) return half_ops_.ops[0][OpIndex(op)];
    if (dt == DataType::kBFloat16) return half_ops_.ops[1][OpIndex(op)];
    return MpiOp(op);
  }
  static Status Layout(const std::vector<int64_t>& bytes,
                       std::vector<int>* counts, std::vector<int>* displs) {
    int64_t off = 0;
    for (int64_t b : bytes) {
      KD_RETURN_IF_ERROR(CheckCount(off + b, "message size"));
      counts->push_back(static_cast<int>(b));
      displs->push_back(static_cast<int>(off));
      off += b;
    }
    return Status::OK();
  }
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  HalfOps half_ops_;
};

}  // namespace

Status MpiStatus(int code, const char* call) {
  if (code == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  const std::string what =
      std::string(call) + " failed: " + std::string(text, len);
#ifdef KERASDIST_ULFM
  int cls = code;
  MPI_Error_class(code, &cls);
  if (cls == MPIX_ERR_PROC_FAILED || cls == MPIX_ERR_PROC_FAILED_PENDING ||
      cls == MPIX_ERR_REVOKED) {
    return Status::RanksLost("a rank of the job was lost (" + what + ")");
  }
#endif
  return Status::Internal(what);
}

namespace {

// Collective over `comm`: *t's ranks; *node holds this node's ranks and
// *leaders (MPI_COMM_NULL but on each node's local rank 0) those ranks in
// rank order, one leader per node, for the backends.
Status SplitByNode(MPI_Comm comm, Topology* t, MPI_Comm* node,
                   MPI_Comm* leaders) {
  MPI_Comm_rank(comm, &t->rank);
  MPI_Comm_size(comm, &t->size);
  MPI_Comm local, cross;
  KD_RETURN_IF_ERROR(
      MpiStatus(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, t->rank,
                                    MPI_INFO_NULL, &local),
                "MPI_Comm_split_type"));
  MPI_Comm_rank(local, &t->local_rank);
  MPI_Comm_size(local, &t->local_size);
  MPI_Comm_set_errhandler(local, MPI_ERRORS_RETURN);
  *node = local;
  KD_RETURN_IF_ERROR(MpiStatus(
      MPI_Comm_split(comm, t->local_rank, t->rank, &cross), "MPI_Comm_split"));
  MPI_Comm_rank(cross, &t->cross_rank);
  MPI_Comm_size(cross, &t->cross_size);
  if (t->local_rank == 0) {
    MPI_Comm_set_errhandler(cross, MPI_ERRORS_RETURN);
    *leaders = cross;
  } else {
    MPI_Comm_free(&cross);
  }
  return Status::OK();
}

}  // namespace

void SkipFinalizeAtExit() {
  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized || !g_we_initialized_mpi) return;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) g_skip_finalize = true;
}

Status MpiContext::Create(bool has_parent, int parent_f,
                          std::unique_ptr<MpiContext>* out) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    return Status::Precondition(
        "MPI has already been finalized in this process; kerasdist.init() "
        "must run before MPI_Finalize.");
  }
  if (!initialized) {
    int provided = 0;
    KD_RETURN_IF_ERROR(CheckSharedMemory());
    const int rc =
        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    DisarmSigbus();
    KD_RETURN_IF_ERROR(MpiStatus(rc, "MPI_Init_thread"));
    g_we_initialized_mpi = true;
    TakePmiWatch();
    MPI_Comm_rank(MPI_COMM_WORLD, &g_world_rank);
    std::atexit(FinalizeAtExit);
  }
  int level = 0;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_SERIALIZED) {
    return Status::Precondition(
        "MPI was initialized with a thread level below MPI_THREAD_SERIALIZED; "
        "kerasdist's background thread needs MPI_THREAD_SERIALIZED or "
        "MPI_THREAD_MULTIPLE (mpi4py asks for MULTIPLE by default).");
  }
  KD_RETURN_IF_ERROR(CheckRecovery());
  KD_RETURN_IF_ERROR(JoinParents());
  MPI_Comm parent = has_parent ? MPI_Comm_f2c(parent_f) : JobWorld();
  // Before the first collective: a rank that froze or went after MPI_Init
  // is named within the deadline instead of waited for in MPI_Comm_dup.
  KD_RETURN_IF_ERROR(StartupCheckIn(parent));
  StartStartupWatch(parent);
  std::unique_ptr<MpiContext> ctx(new MpiContext());
  ctx->control_tag_ = kControlTagBase + (g_generation++ % 16384);
  KD_RETURN_IF_ERROR(
      MpiStatus(MPI_Comm_dup(parent, &ctx->comm_), "MPI_Comm_dup"));
  MPI_Comm_set_errhandler(ctx->comm_, MPI_ERRORS_RETURN);
  // Rank 0's: processes that are in different process sets have made
  // different numbers of contexts.
  KD_RETURN_IF_ERROR(MpiStatus(
      MPI_Bcast(&ctx->control_tag_, 1, MPI_INT, 0, ctx->comm_), "MPI_Bcast"));
  KD_RETURN_IF_ERROR(SplitByNode(ctx->comm_, &ctx->topo_, &ctx->node_comm_,
                                 &ctx->leader_comm_));
  *out = std::move(ctx);
  return Status::OK();
}

MpiContext::~MpiContext() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // A revoked communicator is left to MPI: freeing it would wait for the
  // lost rank.
  if (finalized || revoked_) return;
  for (MPI_Comm* c : {&leader_comm_, &node_comm_, &comm_}) {
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
}

Status MpiContext::SendControl(int dest, std::string bytes) {
  sends_.push_back(Pending{std::move(bytes), MPI_REQUEST_NULL});
  Pending& p = sends_.back();
  KD_RETURN_IF_ERROR(
      CheckCount(static_cast<int64_t>(p.bytes.size()), "control message"));
  return MpiStatus(MPI_Isend(p.bytes.data(), static_cast<int>(p.bytes.size()),
                             MPI_BYTE, dest, control_tag_, comm_, &p.request),
                   "MPI_Isend");
}

Status MpiContext::PollControl(bool* got, int* src, std::string* bytes) {
  int flag = 0;
  MPI_Message msg;
  MPI_Status st;
  KD_RETURN_IF_ERROR(MpiStatus(
      MPI_Improbe(MPI_ANY_SOURCE, control_tag_, comm_, &flag, &msg, &st),
      "MPI_Improbe"));
  *got = flag != 0;
  if (!flag) return Status::OK();
  int n = 0;
  MPI_Get_count(&st, MPI_BYTE, &n);
  bytes->resize(n);
  *src = st.MPI_SOURCE;
  return MpiStatus(
      MPI_Mrecv(bytes->data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE),
      "MPI_Mrecv");
}

Status MpiContext::ProgressSends() {
  while (!sends_.empty()) {
    int done = 0;
    KD_RETURN_IF_ERROR(
        MpiStatus(MPI_Test(&sends_.front().request, &done, MPI_STATUS_IGNORE),
                  "MPI_Test"));
    if (!done) break;
    sends_.pop_front();
  }
  return Status::OK();
}

void MpiContext::FlushSends(double timeout_s) {
  auto until = std::chrono::steady_clock::now() +
               std::chrono::duration<double>(timeout_s);
  while (!sends_.empty() && std::chrono::steady_clock::now() < until) {
    if (!ProgressSends().ok()) return;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void MpiContext::MakeCommunicators(std::unique_ptr<Communicator>* all,
                                   std::unique_ptr<Communicator>* node,
                                   std::unique_ptr<Communicator>* leaders) {
  *all = std::make_unique<MpiCommunicator>(comm_);
  *node = std::make_unique<MpiCommunicator>(node_comm_);
  leaders->reset();
  if (leader_comm_ != MPI_COMM_NULL) {
    *leaders = std::make_unique<MpiCommunicator>(leader_comm_);
  }
}

}  // namespace kerasdist::core
