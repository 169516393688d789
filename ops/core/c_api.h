/* The C API of libkerasdist_core: what Python (ctypes), the TF op library and
 * any other front end use. Every function is safe to call before init. */
#ifndef KERASDIST_CORE_C_API_H_
#define KERASDIST_CORE_C_API_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const char* name;
  int32_t op;        /* OpType */
  int32_t reduce_op; /* ReduceOp */
  int32_t dtype;     /* DataType */
  int32_t ndim;
  const int64_t* shape;
  int32_t root_rank;
  double prescale;
  double postscale;
  int32_t nsplits; /* alltoall; 0 = even split */
  const int64_t* splits;
  const char* group; /* grouped allreduce; NULL or "" = none */
  int32_t group_size;
  int32_t device; /* -1 = host memory */
  /* Process set id; 0 (a zeroed field) = the whole job. A broadcast's
   * root_rank stays a rank of the job (as in Horovod), one of the set's. */
  int32_t process_set;
} kerasdist_request;

/* comm_f: Fortran handle of the MPI communicator (mpi4py: comm.py2f()), used
 * when has_comm is nonzero; else MPI_COMM_WORLD. settings: "KERASDIST_X=value"
 * lines that override the environment. Returns 0, or -1 with
 * kerasdist_last_error(). */
int kerasdist_init(int has_comm, int comm_f, const char* settings);
/* The next kerasdist_init without a communicator runs over TCP, the job as
 * `spec` describes it (transport/tcp_job.h; "" withdraws it). 0, or -1
 * with kerasdist_last_error(). */
int kerasdist_set_tcp_job(const char* spec);
/* The running job's transport, "mpi" or "tcp"; "" when not initialized. */
const char* kerasdist_transport(void);
/* The ranks this process's heartbeat last reported lost: up to `cap` into
 * `out`; returns how many there are. */
int kerasdist_lost_ranks(int32_t* out, int cap);
int kerasdist_shutdown(void);
int kerasdist_is_initialized(void);
/* How many times this process's job was re-formed among the survivors of a
 * lost rank (recovery in place; 0 without it). */
int kerasdist_recoveries(void);
/* Growing in place (recovery in place on; no runtime running): collective
 * over the job. Rank 0 starts `count` new ranks, the i-th running argvs[i]
 * (its words separated by '\x1f', the program first) with hosts[i] as
 * its spawn info ("key=value" lines: "host=h"; "" for none); the other
 * ranks' arguments are unused. The next kerasdist_init starts on the grown
 * job. 0, or -1 with kerasdist_last_error(). */
int kerasdist_grow(int count, const char* const* argvs,
                   const char* const* hosts);
/* How many times this process's job grew in place. */
int kerasdist_grows(void);
/* Shrinking in place (recovery in place on; no runtime running):
 * collective over the job. The ranks with a nonzero `leave` leave it; the
 * next kerasdist_init of the others starts on the job without them.
 * deadline_s: how long the split may take (0: the rendezvous timeout)
 * before this process ends with one line. 0, or -1 with
 * kerasdist_last_error(). */
int kerasdist_shrink(int leave, double deadline_s);
/* How many times this process's job shrank in place (this rank staying). */
int kerasdist_shrinks(void);
const char* kerasdist_last_error(void);
/* -1 when not initialized. */
int kerasdist_rank(void);
int kerasdist_size(void);
int kerasdist_local_rank(void);
int kerasdist_local_size(void);
int kerasdist_cross_rank(void);
int kerasdist_cross_size(void);
int kerasdist_mpi_built(void);
int kerasdist_nccl_built(void);
/* "key=value" lines: versions and backends. */
const char* kerasdist_build_info(void);
/* Names of every KERASDIST_* setting, one per line. */
const char* kerasdist_config_variables(void);
/* The effective settings of the running runtime as "KEY=value" lines (every
 * setting of kerasdist_settings_table, in its order; booleans as 1 or 0).
 * Empty before init. */
const char* kerasdist_current_config(void);
/* The settings table (ops/core/config.cc), one line per setting with five
 * tab-separated fields: NAME, key (its short name), 1 if Python's init()
 * takes the key as a keyword else 0, the default (formatted as
 * kerasdist_current_config does) and a doc line. */
const char* kerasdist_settings_table(void);
/* The settings kerasdist_init(..., settings) would run with (the environment,
 * then the `settings` lines), formatted as kerasdist_current_config; starts
 * nothing. NULL with kerasdist_last_error() for a malformed or unknown one. */
const char* kerasdist_resolve_config(const char* settings);
/* `value` of setting `name` as the runtime would hold it, formatted as
 * kerasdist_current_config does (booleans 1 or 0). NULL with
 * kerasdist_last_error() when malformed or unknown. */
const char* kerasdist_parse_setting(const char* name, const char* value);

/* The enums of ops/core/types.h as "name=value" lines. */
const char* kerasdist_dtypes(void);
const char* kerasdist_reduce_ops(void);
const char* kerasdist_op_types(void);
/* The timeline's event names as "NAME=role" lines, role one of negotiate,
 * queue, copy_in, collective, copy_out (in the order a tensor meets them)
 * and marker (the cycle marker). */
const char* kerasdist_timeline_phases(void);

/* Timeline (rank 0 writes; elsewhere these succeed and do nothing). */
int kerasdist_start_timeline(const char* path, int mark_cycles);
int kerasdist_stop_timeline(void);
/* Names the timeline row of tensor `name` after `label` (a gradient's
   variable); the tensor's name moves to the row's args.tensor. Needs no
   runtime: a label set before init or before a timeline starts is kept.
   0, or -1 with kerasdist_last_error() when an argument is NULL. */
int kerasdist_label_tensor(const char* name, const char* label);
/* Cumulative counters since init. */
int kerasdist_stats(int64_t* allreduced_bytes, int64_t* collectives,
                    double* busy_seconds);
/* Fusion threshold, batching window and response cache, as used by the
 * coordinator (rank 0) from its next decision on. */
int kerasdist_set_tunables(int64_t fusion_threshold_bytes, double cycle_time_ms,
                           int cache_enabled);
int kerasdist_get_tunables(int64_t* fusion_threshold_bytes,
                           double* cycle_time_ms, int* cache_enabled);

/* Enqueueing: the one seam of every front end (the TF kernels, JAX's FFI
 * handlers, the PyTorch ops and Python through the handle API below, which
 * is built on it), as Horovod has one EnqueueTensorAllreduce for every
 * framework. C function pointers, not the core's C++ types, because they
 * cross library and language boundaries unchanged (ctypes, an XLA plugin
 * built without TensorFlow's flags) and need none of the core's headers;
 * callbacks, not a wait, so that a front end completes its own future or
 * op when the core is done instead of parking a thread per call.
 *
 * What `done` receives, valid only during the call: the StatusCode (0 = OK)
 * and its message ("" when OK), the result's shape, the result itself when
 * the core allocated it (`output` and `allocate` were NULL; else NULL), and
 * for alltoall the rows received from each rank. */
typedef struct {
  int32_t status;
  const char* message;
  int32_t ndim;
  const int64_t* shape;
  const void* data;
  int32_t nsplits;
  const int64_t* recv_splits;
} kerasdist_result;
typedef void (*kerasdist_done_fn)(void* arg, const kerasdist_result* result);

/* Allocates a result whose size only negotiation knows (allgather, alltoall,
 * reducescatter enqueued with `output` NULL), so that the collective writes
 * straight into the front end's own tensor: called at most once, on the
 * core's background thread, before the collective writes the result and
 * before `done`. Sets *data to `ndim` dims `shape` of the request's dtype,
 * in the request's memory (host, or its device), and returns 0; or returns
 * a StatusCode (> 0) and sets *message to why, text valid until `done`. */
typedef int32_t (*kerasdist_allocate_fn)(void* arg, int32_t ndim,
                                         const int64_t* shape, void** data,
                                         const char** message);

/* One tensor to enqueue and how it ends. `output`: the preallocated result
 * (it may equal `input`), or NULL for the results whose size only
 * negotiation knows: then `allocate` provides it, or, when `allocate` is
 * NULL too, the core allocates host memory that `done` receives.
 * `ready_event`, for device tensors only, optional: a cudaEvent_t recorded
 * on the stream that produces `input` (and last used `output`), valid until
 * `done`; the core's communication stream waits on it (NULL: the input is
 * complete already). `done(arg, result)` is called exactly once, on the
 * core's background thread, when the tensor finishes or fails: it must not
 * block (it may enqueue more). `allocate` and `done` both get `arg`. */
typedef struct {
  const kerasdist_request* request;
  const void* input;
  void* output;
  void* ready_event;
  kerasdist_allocate_fn allocate;
  kerasdist_done_fn done;
  void* arg;
} kerasdist_tensor;

/* Enqueues `n` tensors in order, under one lock and with one wake-up of the
 * core's thread (a grouped allreduce's members; all of one process set).
 * *queued (optional) says how many were queued: their `done` will be
 * called. Returns 0 when all were; else the StatusCode (> 0) of the first
 * that was not, with kerasdist_last_error() its message, and neither its
 * `done` nor any later one's is called. */
int kerasdist_enqueue_tensors(const kerasdist_tensor* tensors, int32_t n,
                              int32_t* queued);

/* kerasdist_enqueue_tensors of one tensor without `allocate`. Returns 0, or
 * -1 with kerasdist_last_error() and `done` is not called. */
int kerasdist_enqueue_cb(const kerasdist_request* request, const void* input,
                         void* output, void* ready_event,
                         kerasdist_done_fn done, void* arg);

/* Handle API (host memory): enqueue, then wait; for callers with no thread
 * of their own to call back (Python through ctypes). `output` may be NULL
 * for allgather, alltoall and reducescatter (the handle then owns the
 * result). Returns a handle > 0, or 0 with kerasdist_last_error(). */
int64_t kerasdist_enqueue(const kerasdist_request* request, const void* input,
                          void* output);

/* kerasdist_enqueue of a collective whose result negotiation sizes
 * (allgather, alltoall, reducescatter) into the caller's `output`, which
 * holds a result of shape `shape` (`ndim` dims): the core writes there when
 * the negotiated shape is that one; else the result lands in memory the
 * handle owns, as with kerasdist_enqueue (this rank still takes part, so no
 * other waits), and the caller, seeing the other shape from
 * kerasdist_handle_output, says so. Never written past `shape`'s bytes. */
int64_t kerasdist_enqueue_into(const kerasdist_request* request,
                               const void* input, void* output, int32_t ndim,
                               const int64_t* shape);

/* kerasdist_enqueue of `n` requests with one kerasdist_enqueue_tensors call
 * (a grouped allreduce's members: the core sees the group whole). Sets
 * handles[i] for each; returns 0 when all were queued, else -1 with
 * kerasdist_last_error(), and the handles of the requests not queued are 0
 * (those queued before them stay valid and end as usual). `outputs` may be
 * NULL: every result owned by its handle. */
int kerasdist_enqueue_group(const kerasdist_request* requests,
                            const void* const* inputs, void* const* outputs,
                            int32_t n, int64_t* handles);
/* 1 when complete, 0 on timeout (timeout_s < 0 waits forever). */
int kerasdist_wait(int64_t handle, double timeout_s);
/* StatusCode of a completed handle and its message. */
int kerasdist_handle_status(int64_t handle);
const char* kerasdist_handle_message(int64_t handle);
/* Result shape (up to 32 dims) and data of a handle-owned output. */
const void* kerasdist_handle_output(int64_t handle, int32_t* ndim,
                                    int64_t* shape);
int kerasdist_handle_recv_splits(int64_t handle, int64_t* splits);
void kerasdist_release(int64_t handle);

/* Converts n float16 (dtype 0) or bfloat16 (dtype 1) values to float32
 * (to_float != 0) or back, rounding to nearest even, as the data path does;
 * simd = 0 forces the portable scalar code (for tests). kerasdist_simd16()
 * says whether the vector code (F16C/AVX2) is used on this CPU. Needs no init.
 */
int kerasdist_convert16(int32_t dtype, int to_float, int simd, const void* in,
                        void* out, int64_t n);
int kerasdist_simd16(void);
/* The data path's backends in the order a batch tries them, comma-separated
 * ("gpu,self,cma,shm,mpi"; see backends/backends.cc); empty before init. */
const char* kerasdist_backends(void);
/* How many batches backend `name` ran since init, for every backend of that
 * list (fused batches count once; a batch one backend hands to another
 * counts for the one that ran it; "shm" and "cma" together: the single-node
 * allreduces); 0 for a name not in the list; -1 before init. */
int64_t kerasdist_backend_runs(const char* name);

/* Process sets: subsets of the job's ranks whose collectives run on a
 * runtime of their own (its own communicator, negotiation, fusion and
 * response cache). Set 0 is the whole job. Adding and removing are
 * collective over all ranks of the job, which must pass the same ranks (or
 * id) in the same order of calls; they need MPI_THREAD_MULTIPLE.
 * kerasdist_add_process_set: `ranks` are n sorted, distinct ranks of the
 * job; returns the new set's id (> 0), or -1 with kerasdist_last_error(). */
int kerasdist_add_process_set(const int32_t* ranks, int32_t n);
/* Stops set `id`'s runtime (its pending collectives fail); 0, or -1. */
int kerasdist_remove_process_set(int32_t id);
/* The ids of every set (0 first) into `ids` (up to `cap`); how many there
 * are, or -1 before init. */
int kerasdist_process_set_ids(int32_t* ids, int32_t cap);
/* The job ranks of set `id` into `ranks` (up to `cap`); the set's size, or
 * -1 with kerasdist_last_error() for an unknown id. */
int kerasdist_process_set_ranks(int32_t id, int32_t* ranks, int32_t cap);
/* This process's rank within set `id`; -1 when it is not a member, -2 for
 * an unknown id. */
int kerasdist_process_set_rank(int32_t id);

#ifdef __cplusplus
}
#endif

#endif /* KERASDIST_CORE_C_API_H_ */
