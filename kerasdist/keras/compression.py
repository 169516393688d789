"""Gradient compression applied around the allreduce.

A compressor turns a tensor into what goes over the wire and back again:

    wire, ctx = Compression.fp16.compress(grad)
    reduced = kerasdist.allreduce(wire)
    grad = Compression.fp16.decompress(reduced, ctx)

Averaging happens in the runtime on the compressed values, so float16
averages are computed in float16.

The compressors take the tensors of any Keras backend (TensorFlow tensors,
JAX arrays and tracers, PyTorch tensors) and import no framework
themselves: they cast with the tensor's own methods.
"""

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Base class: `compress` before communicating, `decompress` after.

    Subclasses override both static methods. `compress` returns the tensor to
    send and a context (anything) that `decompress` needs to restore it.
    """

    @staticmethod
    def compress(tensor):
        """Returns `(tensor_to_send, ctx)`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the tensor restored from what was received."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating tensors as float16 and casts them back afterwards.

    Halves the bytes of float32 gradients at the cost of float16 precision
    (about 3 significant decimal digits; values above 65504 overflow).
    Non-floating tensors are sent unchanged.
    """

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if not _is_float(dtype) or _is_half(dtype):
            return tensor, None
        return _cast(tensor, "float16"), dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is None:
            return tensor
        return _cast(tensor, ctx)


def _dtype_name(dtype):
    name = getattr(dtype, "name", None)  # tf.DType, numpy (JAX) dtypes
    if isinstance(name, str):
        return name
    return str(dtype).rsplit(".", 1)[-1]  # torch.float16 -> float16


def _is_float(dtype):
    return "float" in _dtype_name(dtype)  # bfloat16 too


def _is_half(dtype):
    return _dtype_name(dtype) == "float16"


def _cast(tensor, dtype):
    """`tensor` as `dtype` (the tensor's own dtype object, or "float16")."""
    framework = type(tensor).__module__.split(".")[0]
    if framework == "torch":
        return tensor.half() if dtype == "float16" else tensor.to(dtype)
    if framework == "tensorflow":
        import tensorflow as tf
        return tf.cast(tensor, dtype)
    return tensor.astype(dtype)  # JAX arrays and tracers, numpy


class Compression:
    """The built-in compressors: `Compression.none` and `Compression.fp16`.

    Example:
    >>> opt = kerasdist.DistributedOptimizer(
    ...     keras.optimizers.SGD(0.01), compression=kerasdist.Compression.fp16)
    """

    none = NoneCompressor
    fp16 = FP16Compressor
