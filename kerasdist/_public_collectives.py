"""The code of the public collectives: `Collectives`, one instance per
framework, whose methods check their arguments, name the collective and
hand the framework's tensors to the instance's implementation module
(`self._impl`; what one provides: `kerasdist/collectives.py`).

`kerasdist.collectives.bound(framework)` builds the instance, and the
public names (`kerasdist.allreduce`, `kerasdist.jax.allreduce`...) are its
methods, each bound once: `help()` shows their signatures without `self`.
Importing this module loads the core library (`basics`), never a
framework.

Over 500 lines: one class, the 18 public collectives, mostly their docstrings
(each the whole contract of its collective).
"""

import inspect

import numpy as np

from kerasdist import basics
from kerasdist import process_sets as _process_sets
from kerasdist._core import capi as _capi
from kerasdist._core import gradients as _gradients


def _check_root(root_rank):
    size = basics.size()
    if (not isinstance(root_rank, (int, np.integer))
            or not 0 <= root_rank < size):
        raise ValueError(f"root_rank must be an int in [0, {size}), got "
                         f"{root_rank!r}.")
    return int(root_rank)


def _on(process_set):
    """The scope in which a collective runs on `process_set` (None or a
    `kerasdist.ProcessSet`; the implementations read it from
    `_capi.current_process_set()`). None keeps the enclosing scope's set
    (the job's outside any), so that code such as DistributedOptimizer's
    can run whole gradient reductions on one set."""
    if process_set is None:
        return _capi.process_set_scope(_capi.current_process_set())
    return _capi.process_set_scope(_process_sets.resolve(process_set))


def _tensor_list(tensors, what):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} expects a list of tensors; got "
                        f"{type(tensors).__name__} (for one tensor call "
                        f"{what.replace('grouped_', '')}).")
    return list(tensors)


def _variable_list(variables, what):
    if hasattr(variables, "assign"):
        variables = [variables]
    variables = list(variables)
    for v in variables:
        if not hasattr(v, "assign"):
            raise TypeError(f"{what} assigns in place, so it takes variables "
                            "(Keras variables, or tf.Variables on "
                            f"TensorFlow); got {type(v).__name__}. Use "
                            "broadcast for tensors.")
    return variables


_instances = {}


def for_framework(framework):
    """The `Collectives` on `framework`'s tensors, built once (what
    `kerasdist.collectives.bound(framework)` returns)."""
    api = _instances.get(framework)
    if api is None:
        if framework == "jax":
            from kerasdist.jax import collectives as impl
        elif framework == "torch":
            from kerasdist.torch import collectives as impl
        elif framework == "tensorflow":
            from kerasdist.tensorflow import collectives as impl
        else:
            raise ValueError(f"no kerasdist collectives on {framework!r}.")
        api = _instances.setdefault(framework, Collectives(impl))
    return api


class Collectives:
    """The public collectives on the tensors of one framework, whose
    implementation module is `impl` (see `kerasdist/collectives.py`).

    Attributes:
        framework: the framework's name ("tensorflow", "jax" or "torch").
    """

    def __init__(self, impl):
        self._impl = impl
        self.framework = impl.FRAMEWORK
        # Each collective bound once, so that `kerasdist.allreduce is
        # kerasdist.jax.allreduce` under the JAX backend.
        for name, value in vars(Collectives).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                setattr(self, name, getattr(self, name))

    def __repr__(self):
        return f"<kerasdist collectives on {self.framework}>"

    def __reduce__(self):
        # Pickled as the framework's instance, and so is each collective
        # (a bound method pickles as getattr(instance, name)).
        return for_framework, (self.framework,)

    def allreduce(self, tensor, op=None, name=None, prescale_factor=1.0,
                  postscale_factor=1.0, average=None, process_set=None):
        """Reduces a tensor over all ranks; every rank gets the result.

        Args:
            tensor: a tensor of the framework (`tf.Tensor`, JAX array or
                `torch.Tensor`) or an array-like: float16, bfloat16,
                float32, float64, int8, int16, int32, int64, uint8 or
                uint16 (on JAX, 64-bit types need `jax_enable_x64`). On
                TensorFlow also a `tf.IndexedSlices`: its values and
                indices are allgathered (Sum and Average only, no scale
                factors: NotImplementedError otherwise, as in Horovod;
                Average divides by `size()`).
            op: `kerasdist.Average` (None, the default), `Sum`, `Min`,
                `Max`, `Product` or `Adasum` (float16/32/64, a power-of-two
                number of ranks). Average of integers divides with
                truncation toward zero.
            name: the name ranks match this collective by. Unnamed calls
                are named the same on every rank: eagerly numbered in call
                order (which must then be the same on every rank), inside
                a `tf.function` or `jax.jit` from the traced program. Give
                one when ranks may issue collectives in different orders
                eagerly.
            prescale_factor: multiplies the input before the reduction.
                Integers are multiplied in float64 and truncated toward
                zero, as in Horovod.
            postscale_factor: multiplies the result after it (integers:
                as the prescale factor).
            average: Horovod's deprecated form of `op`: True is Average,
                False Sum (a DeprecationWarning); ValueError with `op`.
            process_set: a `kerasdist.ProcessSet` added before: reduce
                over its ranks only (only they may call it). Every
                collective here takes it; ranks given to them
                (`root_rank`) stay ranks of the job, as in Horovod. None
                (default): the whole job, or the enclosing set's inside
                one (DistributedOptimizer(process_set=...)).

        Returns:
            A new tensor of the same shape and dtype. Differentiable for
            Sum and Average: the gradient is the same allreduce of the
            incoming gradient.

        Raises:
            RuntimeError: if kerasdist is not initialized.
            ValueError: for an unknown `op`, or both `op` and `average`.
            kerasdist._core.capi.KerasdistError (a RuntimeError; on
                TensorFlow `tf.errors.FailedPreconditionError`, as in
                Horovod): if the ranks disagree about the tensor (shape,
                dtype, op); the message names the ranks.

        Example:
        >>> import kerasdist as kd
        >>> kd.init()
        >>> total = kd.allreduce(keras.ops.ones([2]), op=kd.Sum)
        """
        impl = self._impl
        impl.require_init()
        op = _gradients.resolve_op(op, average)
        impl.check_op(op, "allreduce")
        tensor = impl.tensor(tensor, "allreduce")
        with _on(process_set):
            return impl.allreduce(tensor, op,
                                  impl.auto_name("allreduce", name),
                                  prescale_factor, postscale_factor)

    def grouped_allreduce(self, tensors, op=None, name=None,
                          prescale_factor=1.0, postscale_factor=1.0,
                          average=None, process_set=None):
        """Reduces a list of tensors together, as one collective.

        The members (named `<name>.<i>`) are negotiated together and fused
        into as few collectives as the fusion threshold allows (tensors of
        one dtype share a batch).

        Args:
            tensors: a list of tensors, each as `allreduce` takes
                (`tf.IndexedSlices` among them on TensorFlow: allgathered,
                as `allreduce` does).
            op: `kerasdist.Average` (None, the default), `Sum`, `Min`,
                `Max`, `Product` or `Adasum` (each tensor its own).
            name: the group's name (see `allreduce`).
            prescale_factor: multiplies every input before the reduction.
            postscale_factor: multiplies every result after it.
            average: Horovod's deprecated form of `op` (see `allreduce`).

        Returns:
            A list of reduced tensors, in the input order (empty for an
            empty list). Differentiable for Sum and Average.

        Raises:
            RuntimeError: if kerasdist is not initialized.
            ValueError: for an unknown `op`, or both `op` and `average`.

        Example:
        >>> grads = kd.grouped_allreduce(grads)
        """
        impl = self._impl
        impl.require_init()
        op = _gradients.resolve_op(op, average)
        impl.check_op(op, "grouped_allreduce")
        tensors = [impl.tensor(t, "grouped_allreduce") for t in tensors]
        if not tensors:
            return []
        with _on(process_set):
            return impl.grouped_allreduce(
                tensors, op, impl.auto_name("grouped_allreduce", name),
                prescale_factor, postscale_factor)

    def allgather(self, tensor, name=None, process_set=None):
        """Concatenates every rank's tensor along the first dimension.

        The first dimension may differ between ranks (not inside
        `jax.jit`, where the result's shape is fixed when the function is
        traced: there a mismatch fails with an error naming both shapes);
        the other dimensions must agree.

        Args:
            tensor: a tensor with at least one dimension, of any dtype
                `allreduce` takes, or bool.
            name: the name ranks match this collective by (see
                `allreduce`).

        Returns:
            A tensor with the rows of rank 0, then rank 1, ...
            Differentiable, as in Horovod: each rank gets the average
            (1 / `size()` of the sum) of every rank's
            gradient for its own rows.

        Raises:
            RuntimeError: if kerasdist is not initialized.
            ValueError: for a scalar (JAX, PyTorch).

        Example:
        >>> everyone = kd.allgather(keras.ops.ones([kd.rank() + 1, 3]))
        """
        impl = self._impl
        impl.require_init()
        tensor = impl.tensor(tensor, "allgather")
        with _on(process_set):
            return impl.allgather(tensor, impl.auto_name("allgather", name))

    def broadcast(self, tensor, root_rank, name=None, process_set=None):
        """Every rank receives `root_rank`'s tensor.

        Args:
            tensor: a tensor of the same shape and dtype on every rank (any
                dtype `allreduce` takes, or bool).
            root_rank: the rank whose tensor everyone gets.
            name: the name ranks match this collective by (see
                `allreduce`).

        Returns:
            `root_rank`'s tensor. Differentiable, as in Horovod: the
            gradient flows to the root only, which gets the average of
            every rank's gradient (1 / `size()` of their sum); the others
            get zeros.

        Raises:
            RuntimeError: if kerasdist is not initialized.
            ValueError: if `root_rank` is not an int in `[0, size())`.

        Example:
        >>> weights = kd.broadcast(weights, root_rank=0)
        """
        impl = self._impl
        impl.require_init()
        root_rank = _check_root(root_rank)
        tensor = impl.tensor(tensor, "broadcast")
        with _on(process_set):
            return impl.broadcast(tensor, root_rank,
                                  impl.auto_name("broadcast", name))

    def broadcast_variables(self, variables, root_rank=0,
                            name_prefix="broadcast", process_set=None):
        """Assigns `root_rank`'s values to `variables` on every rank.

        Names derive from the variables' paths, so every rank must pass the
        same variables (in any order). The shards of sharded weights
        (`kerasdist.shard_weights`) are left alone: each rank holds its
        own, started from the root's when they were sharded.

        Args:
            variables: Keras variables (on TensorFlow also `tf.Variable`s).
            root_rank: the rank whose values everyone gets.
            name_prefix: the start of every broadcast's name.

        Raises:
            RuntimeError: if kerasdist is not initialized.
            ValueError: if `root_rank` is not an int in `[0, size())`.

        Example:
        >>> kd.broadcast_variables(model.variables, root_rank=0)
        """
        impl = self._impl
        impl.require_init()
        root_rank = _check_root(root_rank)
        variables = [v for v in variables
                     if getattr(v, "_kerasdist_weight", None) is None]
        names = [f"{name_prefix}.{getattr(v, 'path', None) or v.name}"
                 for v in variables]
        if len(set(names)) != len(names):
            names = [f"{n}.{i}" for i, n in enumerate(names)]
        with impl.no_grad():
            values = [self.broadcast(impl.variable_value(v), root_rank,
                                     name=n, process_set=process_set)
                      for v, n in zip(variables, names)]
            graph = getattr(impl, "global_variables", None)
            if graph is not None and graph() is not None:
                # A TF1 graph: the op that assigns them, as Horovod returns
                # (run it in the session).
                return impl.group(impl.assign(variables, values))
            for v, value in zip(variables, values):
                v.assign(value)

    def alltoall(self, tensor, splits=None, name=None, process_set=None):
        """Sends `splits[r]` rows of `tensor` to rank r and returns what
        arrived.

        Args:
            tensor: a tensor with at least one dimension.
            splits: how many rows go to each rank (`size()` non-negative
                counts summing to the first dimension). None (default)
                divides the first dimension evenly; inside `jax.jit` only
                that is supported, since the received sizes fix the
                result's shape.
            name: the name ranks match this collective by (see
                `allreduce`).

        Returns:
            The rows from every rank in rank order; with `splits` given,
            as in Horovod, (received, received_splits): also how many
            rows came from each rank. Differentiable: the gradient's rows
            go back where they came from.

        Raises:
            RuntimeError: if kerasdist is not initialized.
            ValueError: for malformed `splits` or a scalar (JAX, PyTorch).

        Example:
        >>> received, counts = kd.alltoall(rows, splits=[2, 1])
        """
        impl = self._impl
        impl.require_init()
        tensor = impl.tensor(tensor, "alltoall")
        with _on(process_set):
            received, received_splits = impl.alltoall(
                tensor, splits, impl.auto_name("alltoall", name))
        if splits is None:
            return received
        return received, received_splits

    def reducescatter(self, tensor, op=basics.Average, name=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=None):
        """Reduces over all ranks; rank r keeps its slice of the first
        dimension.

        Earlier ranks get one extra row when the first dimension does not
        divide by `size()`.

        Args:
            tensor: a tensor with at least one dimension, the same shape on
                every rank.
            op: `kerasdist.Average` (default), `Sum`, `Min`, `Max` or
                `Product`.
            name: the name ranks match this collective by (see
                `allreduce`).
            prescale_factor: multiplies the input before the reduction.
            postscale_factor: multiplies the result after it.

        Returns:
            This rank's rows of the reduction. Differentiable for Sum and
            Average, as in Horovod: the gradient is the allgather of the
            incoming ones times the scale factors, and times `size()` for
            Sum (`size()` times the gradient of the sum of the ranks'
            losses).

        Raises:
            RuntimeError: if kerasdist is not initialized.
            ValueError: for an unknown `op` or a scalar (JAX, PyTorch).

        Example:
        >>> mine = kd.reducescatter(keras.ops.ones([4, 2]), op=kd.Sum)
        """
        impl = self._impl
        impl.require_init()
        impl.check_op(op, "reducescatter")
        tensor = impl.tensor(tensor, "reducescatter")
        with _on(process_set):
            return impl.reducescatter(tensor, op,
                                      impl.auto_name("reducescatter", name),
                                      prescale_factor, postscale_factor)

    def barrier(self, name=None, process_set=None):
        """Returns once every rank has called it (inside `jax.jit`: the
        program completes it once every rank's program reached it).

        Args:
            name: the name ranks match this barrier by (see `allreduce`).

        Raises:
            RuntimeError: if kerasdist is not initialized.

        Example:
        >>> kd.barrier()
        """
        impl = self._impl
        impl.require_init()
        with _on(process_set):
            impl.barrier(impl.auto_name("barrier", name))

    def join(self, device=-1):
        """This rank has run out of data: it takes part in the other ranks'
        allreduces with zeros (so theirs complete) until every rank has
        called `join()`, then returns the rank that joined last (as
        Horovod's `hvd.join()`). A job may join more than once (say once
        per epoch); after `join()` returns, collectives go on as before.

        While a rank has joined, only allreduce (and grouped_allreduce)
        can run: any other collective fails on the ranks that submitted it
        with an error saying so. `op=Average` still divides by `size()`
        (the joined ranks count, with their zeros), as in Horovod; Min,
        Max and Product see the zeros too. Unnamed eager collectives are
        numbered afresh on every rank once `join()` returns (the ranks that
        did not join first made unnamed calls the joined ones did not); a
        `join()` inside a `tf.function` does not do that, so name the eager
        collectives that follow it. Eager only on JAX and PyTorch
        (not inside `jax.jit`); TensorFlow: an op, eagerly and in a
        `tf.function`.

        Args:
            device: accepted for Horovod's PyTorch signature
                (`hvd.join(device=-1)`); -1 (the host) or a GPU ordinal
                changes nothing: a joined rank's zeros are host memory.

        Returns:
            TensorFlow: a scalar int32 tensor; JAX and PyTorch: an int.

        Raises:
            RuntimeError: if kerasdist is not initialized, or inside
                `jax.jit`.
            ValueError: if `device` is not an int >= -1.

        Example:
        >>> for batch in my_shard:     # fewer batches on some ranks
        ...     train_step(batch)      # allreduces its gradients
        >>> last = kd.join()
        """
        impl = self._impl
        impl.require_init()
        if (isinstance(device, bool)
                or not isinstance(device, (int, np.integer)) or device < -1):
            raise ValueError(f"join(device=...) takes -1 (the host) or a GPU "
                             f"ordinal, got {device!r}.")
        return impl.join("kerasdist.join")

    def grouped_allgather(self, tensors, name=None, process_set=None):
        """Allgathers each tensor of a list (see `allgather`).

        The members are named `<name>.<i>` and negotiated one by one: the
        allgather ops carry no group (only the allreduce's do), so a group
        is the same as one `allgather` per tensor under those names, issued
        together.

        Args:
            tensors: a list (or tuple) of tensors, each as `allgather`
                takes; the first dimension of each may differ between
                ranks.
            name: the group's name (see `allreduce`).

        Returns:
            A list of gathered tensors, in the input order (empty for an
            empty list). Differentiable as `allgather`.

        Raises:
            RuntimeError: if kerasdist is not initialized.
            TypeError: if `tensors` is not a list or tuple.

        Example:
        >>> a, b = kd.grouped_allgather([x, y])
        """
        impl = self._impl
        impl.require_init()
        tensors = [impl.tensor(t, "allgather")
                   for t in _tensor_list(tensors, "grouped_allgather")]
        if not tensors:
            return []
        with _on(process_set):
            base = impl.auto_name("grouped_allgather", name)
            return [impl.allgather(t, f"{base}.{i}")
                    for i, t in enumerate(tensors)]

    def grouped_reducescatter(self, tensors, op=basics.Average, name=None,
                              prescale_factor=1.0, postscale_factor=1.0,
                              process_set=None):
        """Reducescatters each tensor of a list (see `reducescatter`).

        The members are named `<name>.<i>` and negotiated one by one: the
        reducescatter ops carry no group (only the allreduce's do), so a
        group is the same as one `reducescatter` per tensor under those
        names, issued together.

        Args:
            tensors: a list (or tuple) of tensors, each as `reducescatter`
                takes.
            op: `kerasdist.Average` (default), `Sum`, `Min`, `Max` or
                `Product`.
            name: the group's name (see `allreduce`).
            prescale_factor: multiplies every input before the reduction.
            postscale_factor: multiplies every result after it.

        Returns:
            A list with this rank's rows of each reduction, in the input
            order (empty for an empty list). Differentiable for Sum and
            Average.

        Raises:
            RuntimeError: if kerasdist is not initialized.
            TypeError: if `tensors` is not a list or tuple.
            ValueError: for an unknown `op`.

        Example:
        >>> mine = kd.grouped_reducescatter([a, b], op=kd.Sum)
        """
        impl = self._impl
        impl.require_init()
        impl.check_op(op, "grouped_reducescatter")
        tensors = [impl.tensor(t, "reducescatter")
                   for t in _tensor_list(tensors, "grouped_reducescatter")]
        if not tensors:
            return []
        with _on(process_set):
            base = impl.auto_name("grouped_reducescatter", name)
            return [impl.reducescatter(t, op, f"{base}.{i}", prescale_factor,
                                       postscale_factor)
                    for i, t in enumerate(tensors)]

    def broadcast_(self, variables, root_rank, name=None, process_set=None):
        """Assigns `root_rank`'s values to `variables` in place and returns
        their new values.

        Unlike `broadcast_variables` (names from the variables' paths), the
        members are named `<name>.<i>` by position, so every rank must pass
        the same variables in the same order.

        Args:
            variables: a list of variables: Keras variables, or on
                TensorFlow also `tf.Variable`s.
            root_rank: the rank whose values everyone gets.
            name: the name ranks match this broadcast by (see `allreduce`).

        Returns:
            A list of the variables' values after the assignment (in a
            TensorFlow graph, tensors that run the assignments first).

        Raises:
            RuntimeError: if kerasdist is not initialized.
            TypeError: if an element is not a variable.
            ValueError: if `root_rank` is not an int in `[0, size())`.

        Example:
        >>> kd.broadcast_([model.kernel, model.bias], root_rank=0)
        """
        impl = self._impl
        impl.require_init()
        root_rank = _check_root(root_rank)
        variables = _variable_list(variables, "broadcast_")
        if not variables:
            return []
        with _on(process_set):
            base = impl.auto_name("broadcast_", name)
        with impl.no_grad():
            values = [self.broadcast(impl.variable_value(v), root_rank,
                                     name=f"{base}.{i}",
                                     process_set=process_set)
                      for i, v in enumerate(variables)]
            assign = getattr(impl, "assign", None)
            if assign is not None:
                return assign(variables, values)
            for v, value in zip(variables, values):
                v.assign(value)
        return values

    def broadcast_global_variables(self, root_rank, process_set=None):
        """Broadcasts TensorFlow's global variables
        (`tf.compat.v1.global_variables()`) from `root_rank`, in graph mode.

        As in Horovod, only for TF1-style graphs: it returns the op that
        assigns them (run it in a `tf.compat.v1.Session`). Eagerly (and on
        JAX and PyTorch) there are no global variables: use
        `broadcast_variables(model.variables, root_rank)`.

        Args:
            root_rank: the rank whose values everyone gets.

        Returns:
            A `tf.Operation` that assigns every global variable.

        Raises:
            RuntimeError: eagerly, on JAX or PyTorch, or if kerasdist is not
                initialized.
            ValueError: if `root_rank` is not an int in `[0, size())`.

        Example:
        >>> with tf.Graph().as_default():
        ...     ...
        ...     bcast = kd.broadcast_global_variables(0)
        ...     session.run(bcast)
        """
        impl = self._impl
        impl.require_init()
        root_rank = _check_root(root_rank)
        global_variables = getattr(impl, "global_variables", None)
        variables = None if global_variables is None else global_variables()
        if variables is None:
            raise RuntimeError(
                "kerasdist.broadcast_global_variables() does not support "
                "eager execution. Please use "
                "`kerasdist.broadcast_variables(<model/optimizer variables>)` "
                "instead.")
        return impl.group(self.broadcast_(variables, root_rank,
                                          name="broadcast_global_variables",
                                          process_set=process_set))

    def _topology_op(self, query, what, name):
        impl = self._impl
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{what}(name=...) must be a str or None; got "
                            f"{type(name).__name__}.")
        op = getattr(impl, "topology_op", None)
        if op is not None:
            return op(query, name, what)
        return impl.tensor(np.int32(query()), what)

    def rank_op(self, name=None, process_set_id=0):
        """`rank()` as a scalar int32 tensor. On TensorFlow it is an op
        that reads the rank when it runs (also inside a `tf.function` or
        a graph built before `init()`); on JAX and PyTorch an array of the
        rank when called (inside `jax.jit`: when traced).

        Args:
            name: the op's name (TensorFlow).

        Raises:
            RuntimeError: when it runs before `init()`.

        Example:
        >>> r = kd.rank_op()
        """
        if process_set_id:
            return self._topology_op(
                lambda: _process_sets.set_rank(process_set_id), "rank_op",
                name)
        return self._topology_op(basics.rank, "rank_op", name)

    def local_rank_op(self, name=None):
        """`local_rank()` as a scalar int32 tensor (see `rank_op`).

        Args:
            name: the op's name (TensorFlow).

        Example:
        >>> gpu = kd.local_rank_op()
        """
        return self._topology_op(basics.local_rank, "local_rank_op", name)

    def size_op(self, process_set_id=0, name=None):
        """`size()` as a scalar int32 tensor (see `rank_op`).

        Args:
            process_set_id: the process set (0, the default: the whole
                job) whose size it reads.
            name: the op's name (TensorFlow).

        Raises:
            ValueError: when it runs, for an unknown `process_set_id`.

        Example:
        >>> n = kd.size_op()
        """
        if process_set_id:
            return self._topology_op(
                lambda: _process_sets.set_size(process_set_id), "size_op",
                name)
        return self._topology_op(basics.size, "size_op", name)

    def process_set_included_op(self, process_set_id=0, name=None):
        """1 (int32) if this rank is in process set `process_set_id`,
        else 0 (see `rank_op`).

        Args:
            process_set_id: the set (`ProcessSet.process_set_id`; 0, the
                default, is the whole job).
            name: the op's name (TensorFlow).

        Raises:
            ValueError: when it runs, for an unknown `process_set_id`.

        Example:
        >>> member = kd.process_set_included_op(even.process_set_id)
        """
        return self._topology_op(
            lambda: int(_process_sets.set_rank(process_set_id) >= 0),
            "process_set_included_op", name)

    def local_size_op(self, name=None):
        """`local_size()` as a scalar int32 tensor (see `rank_op`).

        Args:
            name: the op's name (TensorFlow).

        Example:
        >>> per_host = kd.local_size_op()
        """
        return self._topology_op(basics.local_size, "local_size_op", name)
