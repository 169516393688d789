// XLA kernels of the TF collectives: inside tf.function(jit_compile=True)
// (and Keras' jit_compile) each op lowers to an XLA custom call, typed-FFI
// API, whose handler (tf/xla_ffi.cc, JAX's handler bodies) enqueues into the
// core and completes asynchronously, as the JAX front end does. The
// collective's name, process set and reduction travel in the call's backend
// config under the op's own attribute names (tensor_name, process_set,
// reduce_op, prescale_factor, ...: the handlers' bindings, ffi_handlers.h),
// fixed at compile time: the name is the op's tensor_name (the
// graph's unique name inside a tf.function), so negotiation by name does not
// depend on the order XLA runs the calls in. Every call has a side effect:
// XLA must neither drop nor merge a collective other ranks wait for.
//
// XLA needs static shapes, so the results whose size depends on other ranks
// assume what the JAX front end assumes inside jax.jit: allgather, the same
// first dimension on every rank; alltoall, an even split; reducescatter,
// the first dimension split as the core splits it. A rank whose tensors
// disagree gets an error from the handler (the shape check before its copy
// out), never a write past XLA's buffer.
//
// Registered for the CPU's XLA; for a GPU's too in a build with the core's
// GPU backend (KERASDIST_TF_XLA_GPU), for the collectives with CUDA
// handlers (tf/xla_ffi_cuda.cc): allreduce, grouped allreduce, broadcast
// and the barrier. Where a collective has no XLA kernel (the other three on
// a GPU, everything in a build without these kernels) the Python side
// turns Keras' XLA off with a warning, or refuses the collective traced
// into tf.function(jit_compile=True), naming it
// (kerasdist/tensorflow/collectives.py). join has no XLA kernel anywhere:
// a joined rank answers allreduces for as long as the others go on.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/c_api.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tf/xla_targets.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

namespace kerasdist::tf {
namespace {

using ::tensorflow::OpKernelConstruction;
using ::tensorflow::XlaOpKernel;
using ::tensorflow::XlaOpKernelContext;
namespace errors = ::tensorflow::errors;

// `s` as an MLIR string literal.
std::string Quoted(const std::string& s) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string q = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\' || ch < 0x20 || ch >= 0x7f) {
      q += '\\';
      q += kHex[ch >> 4];
      q += kHex[ch & 15];
    } else {
      q += static_cast<char>(ch);
    }
  }
  return q + "\"";
}

std::string I32(int v) { return std::to_string(v) + " : i32"; }

// A double exactly, as MLIR reads it back (a hexadecimal float literal
// must be spelled as the bits of the type).
std::string F64(double v) {
  uint64_t bits;
  static_assert(sizeof(bits) == sizeof(v));
  std::memcpy(&bits, &v, sizeof(v));
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%016llX : f64",
                static_cast<unsigned long long>(bits));
  return buf;
}

// The set's size and this process's rank in it, as the core knows them now
// (they fix the shapes of a compiled step).
::tensorflow::Status SetTopology(int process_set, const std::string& name,
                                 int* size, int* rank) {
  *size = kerasdist_process_set_ranks(process_set, nullptr, 0);
  *rank = kerasdist_process_set_rank(process_set);
  if (*size <= 0 || *rank == -2) {
    return errors::FailedPrecondition(
        "kerasdist: cannot compile collective '", name,
        "' with XLA: kerasdist is not initialized or process set ", process_set,
        " does not exist (call kerasdist.init() first).");
  }
  if (*rank < 0) {
    return errors::FailedPrecondition("kerasdist: collective '", name,
                                      "' is on process set ", process_set,
                                      ", which this process is not part of.");
  }
  return ::tensorflow::Status();
}

class CollectiveXla : public XlaOpKernel {
 public:
  explicit CollectiveXla(OpKernelConstruction* c) : XlaOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &name_));
    if (name_.empty()) name_ = name();
    OP_REQUIRES_OK(c, c->GetAttr("process_set", &process_set_));
  }

 protected:
  // The config's attributes every collective has, then `more`.
  std::string Config(const std::string& more) const {
    std::string c = "{tensor_name = " + Quoted(name_) +
                    ", process_set = " + I32(process_set_);
    if (!more.empty()) c += ", " + more;
    return c + "}";
  }

  xla::XlaOp Call(XlaOpKernelContext* ctx, const char* target,
                  std::vector<xla::XlaOp> operands, const xla::Shape& shape,
                  const std::string& more) const {
    return xla::CustomCall(ctx->builder(), target, operands, shape,
                           Config(more), /*has_side_effect=*/true,
                           /*output_operand_aliasing=*/{},
                           /*literal=*/nullptr,
                           xla::CustomCallSchedule::SCHEDULE_NONE,
                           xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
  }

  // The input's shape; false (with the error set) when it has none.
  bool InShape(XlaOpKernelContext* ctx, int i, bool need_rows,
               xla::Shape* shape) const {
    auto s = ctx->InputXlaShape(i);
    if (!s.ok()) {
      ctx->SetStatus(s.status());
      return false;
    }
    *shape = *std::move(s);
    if (need_rows && shape->dimensions_size() == 0) {
      ctx->SetStatus(errors::InvalidArgument(
          "kerasdist: collective '", name_,
          "' needs a tensor with a first dimension, got a scalar."));
      return false;
    }
    return true;
  }

  std::string name_;
  int process_set_ = 0;
};

std::string ReduceConfig(int reduce_op, float prescale, float postscale) {
  return "reduce_op = " + I32(reduce_op) +
         ", prescale_factor = " + F64(prescale) +
         ", postscale_factor = " + F64(postscale);
}

class ReduceXla : public CollectiveXla {
 public:
  explicit ReduceXla(OpKernelConstruction* c) : CollectiveXla(c) {
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
    OP_REQUIRES_OK(c, c->GetAttr("prescale_factor", &prescale_));
    OP_REQUIRES_OK(c, c->GetAttr("postscale_factor", &postscale_));
  }

 protected:
  std::string Reduce() const {
    return ReduceConfig(reduce_op_, prescale_, postscale_);
  }
  int reduce_op_ = 0;
  float prescale_ = 1.0f;
  float postscale_ = 1.0f;
};

class AllreduceXla : public ReduceXla {
 public:
  explicit AllreduceXla(OpKernelConstruction* c) : ReduceXla(c) {
    std::string group;
    OP_REQUIRES_OK(c, c->GetAttr("group", &group));
    OP_REQUIRES(
        c, group.empty(),
        errors::Unimplemented(
            "kerasdist: allreduce '", name_, "' is a member of group '", group,
            "', which XLA cannot compile; use grouped_allreduce "
            "inside tf.function(jit_compile=True)."));
  }
  void Compile(XlaOpKernelContext* ctx) override {
    xla::Shape shape;
    if (!InShape(ctx, 0, false, &shape)) return;
    ctx->SetOutput(0, Call(ctx, xla_targets::kAllreduce, {ctx->Input(0)}, shape,
                           Reduce()));
  }
};

class GroupedAllreduceXla : public ReduceXla {
 public:
  using ReduceXla::ReduceXla;
  void Compile(XlaOpKernelContext* ctx) override {
    std::vector<xla::XlaOp> ins;
    std::vector<::tensorflow::TensorShape> unused;
    OP_REQUIRES_OK(ctx, ctx->InputList("tensors", &ins, &unused));
    std::vector<xla::Shape> shapes(ins.size());
    for (size_t i = 0; i < ins.size(); ++i) {
      if (!InShape(ctx, static_cast<int>(i), false, &shapes[i])) return;
    }
    xla::XlaOp out = Call(ctx, xla_targets::kGroupedAllreduce, ins,
                          xla::ShapeUtil::MakeTupleShape(shapes), Reduce());
    for (size_t i = 0; i < ins.size(); ++i) {
      ctx->SetOutput(static_cast<int>(i),
                     xla::GetTupleElement(out, static_cast<int64_t>(i)));
    }
  }
};

class AllgatherXla : public CollectiveXla {
 public:
  using CollectiveXla::CollectiveXla;
  void Compile(XlaOpKernelContext* ctx) override {
    xla::Shape shape;
    if (!InShape(ctx, 0, true, &shape)) return;
    int size, rank;
    OP_REQUIRES_OK(ctx, SetTopology(process_set_, name_, &size, &rank));
    shape.set_dimensions(0, shape.dimensions(0) * size);
    ctx->SetOutput(
        0, Call(ctx, xla_targets::kAllgather, {ctx->Input(0)}, shape, ""));
  }
};

class BroadcastXla : public CollectiveXla {
 public:
  explicit BroadcastXla(OpKernelConstruction* c) : CollectiveXla(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
  }
  void Compile(XlaOpKernelContext* ctx) override {
    xla::Shape shape;
    if (!InShape(ctx, 0, false, &shape)) return;
    ctx->SetOutput(0, Call(ctx, xla_targets::kBroadcast, {ctx->Input(0)}, shape,
                           "root_rank = " + I32(root_rank_)));
  }

 private:
  int root_rank_ = 0;
};

class ReducescatterXla : public ReduceXla {
 public:
  using ReduceXla::ReduceXla;
  void Compile(XlaOpKernelContext* ctx) override {
    xla::Shape shape;
    if (!InShape(ctx, 0, true, &shape)) return;
    int size, rank;
    OP_REQUIRES_OK(ctx, SetTopology(process_set_, name_, &size, &rank));
    // The core's split: the first rows % size ranks get one row more.
    const int64_t rows = shape.dimensions(0);
    shape.set_dimensions(0, rows / size + (rank < rows % size ? 1 : 0));
    ctx->SetOutput(0, Call(ctx, xla_targets::kReducescatter, {ctx->Input(0)},
                           shape, Reduce()));
  }
};

class AlltoallXla : public CollectiveXla {
 public:
  using CollectiveXla::CollectiveXla;
  void Compile(XlaOpKernelContext* ctx) override {
    xla::Shape shape;
    if (!InShape(ctx, 0, true, &shape)) return;
    int size, rank;
    OP_REQUIRES_OK(ctx, SetTopology(process_set_, name_, &size, &rank));
    const int64_t rows = shape.dimensions(0);
    std::vector<int64_t> splits;
    OP_REQUIRES_OK(ctx, ctx->ConstantInputAsIntVector(1, &splits));
    const std::vector<int64_t> even(size, rows / size);
    OP_REQUIRES(
        ctx, rows % size == 0 && (splits.empty() || splits == even),
        errors::Unimplemented(
            "kerasdist: alltoall '", name_,
            "' inside tf.function(jit_compile=True) supports only an even "
            "split (splits=None, and a first dimension divisible by the "
            "set's size, ",
            size,
            "): the received sizes would fix the result's shape. Call it "
            "outside jit_compile for other splits."));
    std::string list;
    for (int64_t s : even)
      list += (list.empty() ? "" : ", ") + std::to_string(s);
    ctx->SetOutput(0, Call(ctx, xla_targets::kAlltoall, {ctx->Input(0)}, shape,
                           "splits = array<i64: " + list + ">"));
    ctx->SetOutput(1, xla::ConstantR1<int64_t>(ctx->builder(), even));
  }
};

// The barrier has no result in TF; its custom call writes a scalar that
// nothing reads (XLA keeps the call: it has a side effect).
class BarrierXla : public CollectiveXla {
 public:
  using CollectiveXla::CollectiveXla;
  void Compile(XlaOpKernelContext* ctx) override {
    Call(ctx, xla_targets::kBarrier, {}, xla::ShapeUtil::MakeShape(xla::U8, {}),
         "");
  }
};

}  // namespace

// TensorFlow turns the XLA op registrations into kernels of its XLA
// devices once, at its first XLA compilation
// (XlaOpRegistry::RegisterCompilationKernels); REGISTER_XLA_OP alone in a
// library loaded after that (kerasdist loads its ops lazily, often after
// the user's first jit_compile) registers nothing TF would find: "No
// registered 'KerasdistAllreduce' OpKernel for XLA_CPU_JIT devices". So
// TF's registrations are turned into kernels first (a no-op when done
// already), then the ops are registered with tf2xla (what it asks of an
// op: compile-time constant inputs) and as kernels of the CPU's XLA device
// directly, as RegisterCompilationKernels would have. Static objects of
// one file are constructed in order: this one comes first.
[[maybe_unused]] const bool kTfXlaKernelsRegistered = [] {
  ::tensorflow::XlaOpRegistry::RegisterCompilationKernels();
  return true;
}();

#define KD_REGISTER_XLA(NAME, CLASS)                                           \
  REGISTER_XLA_OP(Name(NAME).Device(::tensorflow::DEVICE_CPU_XLA_JIT), CLASS); \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(::tensorflow::DEVICE_CPU_XLA_JIT), \
                          CLASS)

KD_REGISTER_XLA("KerasdistAllreduce", AllreduceXla);
KD_REGISTER_XLA("KerasdistGroupedAllreduce", GroupedAllreduceXla);
KD_REGISTER_XLA("KerasdistAllgather", AllgatherXla);
KD_REGISTER_XLA("KerasdistBroadcast", BroadcastXla);
KD_REGISTER_XLA("KerasdistReducescatter", ReducescatterXla);
KD_REGISTER_XLA("KerasdistBarrier", BarrierXla);

#ifdef KERASDIST_TF_XLA_GPU
// The same kernels on a GPU's XLA, whose custom calls reach the CUDA
// handlers: the call's target is the same, XLA picks the handler of the
// platform it compiles for.
#define KD_REGISTER_XLA_GPU(NAME, CLASS)                                       \
  REGISTER_XLA_OP(Name(NAME).Device(::tensorflow::DEVICE_GPU_XLA_JIT), CLASS); \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(::tensorflow::DEVICE_GPU_XLA_JIT), \
                          CLASS)

KD_REGISTER_XLA_GPU("KerasdistAllreduce", AllreduceXla);
KD_REGISTER_XLA_GPU("KerasdistGroupedAllreduce", GroupedAllreduceXla);
KD_REGISTER_XLA_GPU("KerasdistBroadcast", BroadcastXla);
KD_REGISTER_XLA_GPU("KerasdistBarrier", BarrierXla);
#endif  // KERASDIST_TF_XLA_GPU
REGISTER_XLA_OP(Name("KerasdistAlltoall")
                    .Device(::tensorflow::DEVICE_CPU_XLA_JIT)
                    .CompileTimeConstantInput("splits"),
                AlltoallXla);
REGISTER_KERNEL_BUILDER(Name("KerasdistAlltoall")
                            .Device(::tensorflow::DEVICE_CPU_XLA_JIT)
                            .HostMemory("splits"),
                        AlltoallXla);

}  // namespace kerasdist::tf
