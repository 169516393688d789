#include "enqueue.h"

#ifdef KERASDIST_NO_MPI  // ops/Makefile: a source in CORE_PLAIN_SRCS
#error "this source sees mpi.h: list it in ops/Makefile's CORE_MPI_SRCS"
#endif

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "process_sets.h"
#include "types.h"

namespace kerasdist::core {

namespace {

Request RequestFromC(const kerasdist_request* r) {
  Request q;
  q.name = r->name ? r->name : "";
  q.op = static_cast<OpType>(r->op);
  q.reduce_op = static_cast<ReduceOp>(r->reduce_op);
  q.dtype = static_cast<DataType>(r->dtype);
  q.shape.assign(r->shape, r->shape + r->ndim);
  q.root_rank = r->root_rank;
  q.prescale = r->prescale;
  q.postscale = r->postscale;
  if (r->nsplits > 0) q.splits.assign(r->splits, r->splits + r->nsplits);
  q.group = r->group ? r->group : "";
  q.group_size = r->group_size;
  q.device = r->device;
  if (q.op == OpType::kBarrier) q.shape.clear();
  if (q.op == OpType::kJoin) {  // no tensor; the result is an int32 rank
    q.shape.clear();
    q.dtype = DataType::kInt32;
    q.device = -1;
  }
  return q;
}

Status CheckTensor(const kerasdist_tensor& t) {
  const kerasdist_request* r = t.request;
  if (r == nullptr || !IsValidOpType(r->op) || !IsValidDataType(r->dtype) ||
      !IsValidReduceOp(r->reduce_op) || r->ndim < 0 || r->ndim > 32) {
    return Status::InvalidArgument(
        "invalid request: unknown op, dtype or reduce op, or more than 32 "
        "dimensions.");
  }
  if (t.done == nullptr) {
    return Status::InvalidArgument(
        "kerasdist_enqueue_tensors needs a done callback.");
  }
  return Status::OK();
}

// One tensor from its enqueue to its `done`: the caller's callbacks, and
// what `done` receives. Its entry's `done` deletes it; the entry's lambdas
// hold only a pointer to it (no allocation of their own per tensor).
struct Pending {
  kerasdist_allocate_fn allocate;
  kerasdist_done_fn done;
  void* arg;
  void* output;
  int64_t element_size;
  bool on_device;
  std::vector<int64_t> shape;  // the result's
  std::vector<char> owned;     // a result the core allocated
};

// The entry's allocate: the caller's `output` when it gave one, else its
// `allocate`, else memory the core owns (host only).
Status Allocate(Pending& p, const std::vector<int64_t>& shape, void** data) {
  p.shape = shape;
  if (p.output != nullptr) {
    *data = p.output;
    return Status::OK();
  }
  if (p.allocate != nullptr) {
    const char* message = "the front end could not allocate the output.";
    const int32_t code = p.allocate(p.arg, static_cast<int32_t>(shape.size()),
                                    shape.data(), data, &message);
    if (code == 0) return Status::OK();
    return Status(static_cast<StatusCode>(code), message ? message : "");
  }
  if (p.on_device) {
    return Status::InvalidArgument(
        "a device tensor needs a preallocated output of the result's size "
        "(the C API allocates host memory only).");
  }
  p.owned.resize(std::max<int64_t>(NumElements(shape) * p.element_size, 1));
  *data = p.owned.data();
  return Status::OK();
}

// The entry's done: the result as kerasdist_result, to the caller.
void Finish(Pending* p, const Result& res) {
  kerasdist_result out{};
  out.status = static_cast<int32_t>(res.status.code());
  out.message = res.status.message().c_str();
  out.ndim = static_cast<int32_t>(p->shape.size());
  out.shape = p->shape.data();
  out.data = p->owned.empty() ? nullptr : p->owned.data();
  out.nsplits = static_cast<int32_t>(res.recv_splits.size());
  out.recv_splits = res.recv_splits.data();
  p->done(p->arg, &out);
  delete p;
}

// The entry of `t`; *pending is what its lambdas point to.
Entry EntryFromC(const kerasdist_tensor& t, Pending** pending) {
  Entry e;
  e.req = RequestFromC(t.request);
  e.input = t.input;
  e.output = t.output;
  e.ready_event = e.req.device >= 0 ? t.ready_event : nullptr;
  auto* p = new Pending{t.allocate,
                        t.done,
                        t.arg,
                        t.output,
                        DataTypeSize(e.req.dtype),
                        e.req.device >= 0,
                        e.req.shape,
                        {}};
  e.allocate = [p](const std::vector<int64_t>& shape, void** data) {
    return Allocate(*p, shape, data);
  };
  e.done = [p](const Result& res) { Finish(p, res); };
  *pending = p;
  return e;
}

// The runtime of the entries' process set (one for all), a broadcast's root
// turned into the set's rank.
Status RuntimeFor(const kerasdist_tensor* t, std::vector<Entry>& entries,
                  std::shared_ptr<Runtime>* rt) {
  const int32_t set = t[0].request->process_set;
  KD_RETURN_IF_ERROR(RuntimeForSet(set, &entries[0].req, rt));
  for (size_t i = 1; i < entries.size(); ++i) {
    if (t[i].request->process_set != set) {
      return Status::InvalidArgument(
          "kerasdist_enqueue_tensors: every tensor of one call must be of "
          "the same process set.");
    }
    if (entries[i].req.op != OpType::kBroadcast) continue;
    std::shared_ptr<Runtime> same;
    KD_RETURN_IF_ERROR(RuntimeForSet(set, &entries[i].req, &same));
  }
  return Status::OK();
}

}  // namespace

Status EnqueueTensors(const kerasdist_tensor* t, int32_t n, int32_t* queued) {
  *queued = 0;
  if (n <= 0 || t == nullptr) {
    return n == 0 ? Status::OK()
                  : Status::InvalidArgument(
                        "kerasdist_enqueue_tensors: no tensors given.");
  }
  for (int32_t i = 0; i < n; ++i) {
    Status s = CheckTensor(t[i]);
    // Not initialized comes first: the request may be fine once it is.
    if (!s.ok() && !CurrentRuntime()) {
      return Status::Precondition(
          "kerasdist is not initialized; call kerasdist.init() first.");
    }
    KD_RETURN_IF_ERROR(s);
  }
  std::vector<Entry> entries(n);
  std::vector<Pending*> pending(n);
  for (int32_t i = 0; i < n; ++i) entries[i] = EntryFromC(t[i], &pending[i]);
  std::shared_ptr<Runtime> rt;
  size_t done = 0;
  Status s = RuntimeFor(t, entries, &rt);
  if (s.ok()) s = rt->EnqueueMany(entries, &done);
  *queued = static_cast<int32_t>(done);
  // The entries not queued are never called back.
  for (size_t i = done; i < pending.size(); ++i) delete pending[i];
  return s;
}

}  // namespace kerasdist::core
