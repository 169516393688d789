// The handle API of c_api.h (kerasdist_enqueue, kerasdist_wait, ...), for
// callers with no thread of their own to call back (Python through ctypes).
// Built on kerasdist_enqueue_tensors like every other front end: a handle's
// `allocate` puts a result whose size only negotiation knows into memory the
// handle owns, and its `done` records the result for the waiters.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "c_api.h"
#include "status.h"
#include "types.h"

namespace kerasdist::core {

namespace {

// One enqueued tensor and, once `done` is set, how it ended (mu guards what
// follows it). `self` keeps the handle alive while the core holds it, even
// after kerasdist_release.
struct Handle {
  std::shared_ptr<Handle> self;
  int64_t element_size = 1;
  bool on_device = false;
  std::vector<char> owned;  // a result the handle allocated
  // kerasdist_enqueue_into: the caller's buffer, for a result of these dims.
  void* into = nullptr;
  std::vector<int64_t> into_dims;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int32_t status = 0;
  std::string message;
  std::vector<int64_t> shape;
  std::vector<int64_t> recv_splits;
};

std::mutex g_mu;  // guards g_handles and g_next
std::map<int64_t, std::shared_ptr<Handle>> g_handles;
int64_t g_next = 1;
thread_local std::string t_text;

std::shared_ptr<Handle> Find(int64_t h) {
  std::lock_guard<std::mutex> l(g_mu);
  auto it = g_handles.find(h);
  return it == g_handles.end() ? nullptr : it->second;
}

int32_t Allocate(void* arg, int32_t ndim, const int64_t* shape, void** data,
                 const char** message) {
  Handle& h = *static_cast<Handle*>(arg);
  if (h.on_device) {
    *message =
        "a device tensor needs a preallocated output of the result's size "
        "(the C API allocates host memory only).";
    return static_cast<int32_t>(StatusCode::kInvalidArgument);
  }
  const std::vector<int64_t> dims(shape, shape + ndim);
  if (h.into != nullptr && dims == h.into_dims) {
    *data = h.into;
    return 0;
  }
  // Another shape than the caller's buffer holds: the result lands here, the
  // rank taking part as the others do, and the caller sees the shape.
  h.owned.resize(std::max<int64_t>(NumElements(dims) * h.element_size, 1));
  *data = h.owned.data();
  return 0;
}

void Done(void* arg, const kerasdist_result* r) {
  Handle& h = *static_cast<Handle*>(arg);
  std::shared_ptr<Handle> keep = std::move(h.self);  // released on return
  std::lock_guard<std::mutex> l(h.mu);
  h.status = r->status;
  h.message = r->message;
  h.shape.assign(r->shape, r->shape + r->ndim);
  h.recv_splits.assign(r->recv_splits, r->recv_splits + r->nsplits);
  h.done = true;
  h.cv.notify_all();
}

// kerasdist_enqueue_group, where `into` (if not null) holds where the one
// request's result goes when it has `into_dims`.
int EnqueueHandles(const kerasdist_request* requests, const void* const* inputs,
                   void* const* outputs, int32_t n, int64_t* handles,
                   const Handle* into) {
  if (n < 0 || (n > 0 && (inputs == nullptr || handles == nullptr))) {
    kerasdist_enqueue_tensors(nullptr, -1, nullptr);  // sets the error
    return -1;
  }
  std::vector<std::shared_ptr<Handle>> hs(n);
  std::vector<kerasdist_tensor> tensors(n);
  for (int32_t i = 0; i < n; ++i) {
    // A NULL request is the core's to refuse, with its message.
    const kerasdist_request* r = requests ? &requests[i] : nullptr;
    auto h = std::make_shared<Handle>();
    if (r != nullptr && IsValidDataType(r->dtype)) {
      h->element_size = DataTypeSize(static_cast<DataType>(r->dtype));
      h->on_device = r->device >= 0;
    }
    if (into != nullptr) {
      h->into = into->into;
      h->into_dims = into->into_dims;
    }
    h->self = h;  // the core's reference, dropped by Done
    void* output = outputs ? outputs[i] : nullptr;
    tensors[i] = {r, inputs[i], output, nullptr, &Allocate, &Done, h.get()};
    hs[i] = std::move(h);
  }
  {
    std::lock_guard<std::mutex> l(g_mu);
    for (int32_t i = 0; i < n; ++i) {
      handles[i] = g_next++;
      g_handles[handles[i]] = hs[i];
    }
  }
  int32_t queued = 0;
  if (kerasdist_enqueue_tensors(tensors.data(), n, &queued) == 0) return 0;
  // The requests not queued are never called back: their handles go.
  std::lock_guard<std::mutex> l(g_mu);
  for (int32_t i = queued; i < n; ++i) {
    hs[i]->self.reset();
    g_handles.erase(handles[i]);
    handles[i] = 0;
  }
  return -1;
}

}  // namespace

}  // namespace kerasdist::core

using namespace kerasdist::core;

extern "C" {

int64_t kerasdist_enqueue(const kerasdist_request* r, const void* input,
                          void* output) {
  int64_t id = 0;
  EnqueueHandles(r, &input, &output, 1, &id, nullptr);
  return id;
}

int64_t kerasdist_enqueue_into(const kerasdist_request* r, const void* input,
                               void* output, int32_t ndim,
                               const int64_t* shape) {
  // An op whose result has the input's shape writes into `output` anyway.
  const bool negotiated =
      r != nullptr && IsValidOpType(r->op) &&
      (static_cast<OpType>(r->op) == OpType::kAllgather ||
       static_cast<OpType>(r->op) == OpType::kAlltoall ||
       static_cast<OpType>(r->op) == OpType::kReducescatter);
  if (!negotiated) return kerasdist_enqueue(r, input, output);
  Handle into;
  into.into = output;
  if (ndim > 0 && shape != nullptr) into.into_dims.assign(shape, shape + ndim);
  int64_t id = 0;
  void* none = nullptr;
  EnqueueHandles(r, &input, &none, 1, &id, &into);
  return id;
}

int kerasdist_enqueue_group(const kerasdist_request* requests,
                            const void* const* inputs, void* const* outputs,
                            int32_t n, int64_t* handles) {
  return EnqueueHandles(requests, inputs, outputs, n, handles, nullptr);
}

int kerasdist_wait(int64_t handle, double timeout_s) {
  auto h = Find(handle);
  if (!h) return 1;
  std::unique_lock<std::mutex> l(h->mu);
  if (timeout_s < 0) {
    h->cv.wait(l, [&] { return h->done; });
    return 1;
  }
  return h->cv.wait_for(l, std::chrono::duration<double>(timeout_s),
                        [&] { return h->done; })
             ? 1
             : 0;
}

int kerasdist_handle_status(int64_t handle) {
  auto h = Find(handle);
  if (!h) return static_cast<int>(StatusCode::kInvalidArgument);
  std::lock_guard<std::mutex> l(h->mu);
  return h->status;
}

const char* kerasdist_handle_message(int64_t handle) {
  auto h = Find(handle);
  if (!h) {
    t_text = "unknown handle";
  } else {
    std::lock_guard<std::mutex> l(h->mu);
    t_text = h->message;
  }
  return t_text.c_str();
}

const void* kerasdist_handle_output(int64_t handle, int32_t* ndim,
                                    int64_t* shape) {
  auto h = Find(handle);
  if (!h) return nullptr;
  std::lock_guard<std::mutex> l(h->mu);
  *ndim = static_cast<int32_t>(h->shape.size());
  for (size_t i = 0; i < h->shape.size() && i < 32; ++i) shape[i] = h->shape[i];
  return h->owned.empty() ? nullptr : h->owned.data();
}

int kerasdist_handle_recv_splits(int64_t handle, int64_t* splits) {
  auto h = Find(handle);
  if (!h) return 0;
  std::lock_guard<std::mutex> l(h->mu);
  std::copy(h->recv_splits.begin(), h->recv_splits.end(), splits);
  return static_cast<int>(h->recv_splits.size());
}

void kerasdist_release(int64_t handle) {
  std::lock_guard<std::mutex> l(g_mu);
  g_handles.erase(handle);
}

}  // extern "C"
