// Op registrations: attributes, shape functions and docs. The kernels are in
// kernels.cc. Every op is stateful: two collectives must never be merged or
// pruned by graph optimisations, since other ranks are waiting for them.
//
// The attributes (tensor_name, process_set, reduce_op, prescale_factor,
// postscale_factor, root_rank, group, group_size) are the vocabulary of
// every front end's compiled collectives: the XLA FFI handlers that JAX and
// TF's XLA kernels call bind theirs by the same names (jax/ffi_handlers.h).
// They are also what a saved graph records, so they keep their names. The
// scale factors are float here, as a TF attribute has no 64-bit float; the
// handlers take them as double, which holds every float exactly.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace kerasdist::tf {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// The dtypes the reducing ops take; the others also take bool.
#define KD_REDUCED \
  "half, bfloat16, float, double, int8, int16, int32, int64, uint8, uint16"

namespace {

Status UnknownFirstDim(InferenceContext* c) {
  ShapeHandle in = c->input(0);
  if (!c->RankKnown(in)) {
    c->set_output(0, c->UnknownShape());
    return Status();
  }
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
  c->set_output(0, out);
  return Status();
}

}  // namespace

REGISTER_OP("KerasdistAllreduce")
    .Attr("T: {" KD_REDUCED "}")
    .Attr("tensor_name: string")
    .Attr("process_set: int = 0")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("group: string = ''")
    .Attr("group_size: int = 0")
    .Input("tensor: T")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Reduces `tensor` over all ranks (see kerasdist.allreduce).");

// One kernel for a whole list: one dispatch and one completion for N tensors,
// where N separate ops would cost TF's per-op overhead N times.
REGISTER_OP("KerasdistGroupedAllreduce")
    .Attr("T: list({" KD_REDUCED "})")
    .Attr("tensor_name: string")
    .Attr("process_set: int = 0")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Input("tensors: T")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return Status();
    })
    .Doc(
        "Reduces a list of tensors over all ranks, together (names "
        "`tensor_name.0`, `tensor_name.1`, ...).");

REGISTER_OP("KerasdistAllgather")
    .Attr("T: {" KD_REDUCED ", bool}")
    .Attr("tensor_name: string")
    .Attr("process_set: int = 0")
    .Input("tensor: T")
    .Output("gathered: T")
    .SetIsStateful()
    .SetShapeFn(UnknownFirstDim)
    .Doc("Concatenates `tensor` of every rank along the first dimension.");

REGISTER_OP("KerasdistBroadcast")
    .Attr("T: {" KD_REDUCED ", bool}")
    .Attr("tensor_name: string")
    .Attr("process_set: int = 0")
    .Attr("root_rank: int")
    .Input("tensor: T")
    .Output("broadcast: T")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Every rank receives `tensor` of `root_rank`.");

REGISTER_OP("KerasdistAlltoall")
    .Attr("T: {" KD_REDUCED ", bool}")
    .Attr("tensor_name: string")
    .Attr("process_set: int = 0")
    .Input("tensor: T")
    .Input("splits: int64")
    .Output("received: T")
    .Output("received_splits: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(UnknownFirstDim(c));
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      return Status();
    })
    .Doc(
        "Sends splits[r] rows of `tensor` to rank r; an empty `splits` "
        "divides the first dimension evenly.");

REGISTER_OP("KerasdistReducescatter")
    .Attr("T: {" KD_REDUCED "}")
    .Attr("tensor_name: string")
    .Attr("process_set: int = 0")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Input("tensor: T")
    .Output("scattered: T")
    .SetIsStateful()
    .SetShapeFn(UnknownFirstDim)
    .Doc(
        "Reduces `tensor` over all ranks; rank r keeps the r-th slice of the "
        "first dimension (earlier ranks get one more row when it does not "
        "divide evenly).");

REGISTER_OP("KerasdistBarrier")
    .Attr("tensor_name: string")
    .Attr("process_set: int = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc("Returns when every rank has reached the barrier.");

REGISTER_OP("KerasdistJoin")
    .Attr("tensor_name: string")
    // Every collective kernel reads it; a join is always the job's (set 0),
    // as in Horovod.
    .Attr("process_set: int = 0")
    .Output("last_joined_rank: int32")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc(
        "This rank has no more data: takes part in the other ranks' "
        "allreduces with zeros until every rank has joined; returns the last "
        "rank to join.");

}  // namespace kerasdist::tf
