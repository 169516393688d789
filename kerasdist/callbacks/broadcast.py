"""BroadcastGlobalVariablesCallback: every rank starts from root's state."""

import keras

from kerasdist import basics
from kerasdist.callbacks import _util
from kerasdist.keras import framework as _framework
from kerasdist.keras import optimizer as _optimizer


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Copies the model's weights and the optimizer's state from one rank.

    Ranks initialise their models independently (different random seeds,
    or a checkpoint loaded on one rank only). At the start of training this
    callback creates the optimizer's variables if they do not exist yet
    (Keras 3 creates them lazily, at the first step) and broadcasts the
    model's weights (trainable and non-trainable) and every optimizer
    variable, iteration count included, from `root_rank` to all ranks. It
    does this at every `fit` call, so a job that resumes from a checkpoint
    loaded before `fit` starts from the loaded state everywhere.

    When the model is not built when `fit` starts (a subclassed model, or a
    `Sequential` without an `Input`), the broadcast runs after the first
    batch instead, as in Horovod: that first step starts from different
    weights, every later step from the same ones.

    Args:
        root_rank: the rank whose state is copied.
        verify: if True, compare a fingerprint of every variable across
            ranks after the broadcast, and of the trainable weights and
            optimizer variables at every epoch end; raise if one differs.
            It costs one small allgather per check.
        local_variables: a variable or a list of variables (Keras
            variables, or tf.Variables on TensorFlow) that keep each rank's
            own value, as Horovod's: they are neither broadcast nor
            verified (and `verify` then leaves the optimizer's variables
            out at epoch ends, since the slots of local variables differ).
            Every rank must pass the same ones.

    Raises:
        ValueError: if `root_rank` is not a rank of the job, or an element
            of `local_variables` is not a variable.
        RuntimeError: with `verify=True`, naming the first variable that
            differs between ranks.

    Example:

    ```python
    kerasdist.init()
    model.fit(x, y, callbacks=[
        kerasdist.callbacks.BroadcastGlobalVariablesCallback(0)])
    ```
    """

    def __init__(self, root_rank=0, verify=False, local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.verify = verify
        self._pending = False
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        if not all(_is_variable(v) for v in local_variables):
            raise ValueError("BroadcastGlobalVariablesCallback: all local "
                             "variables must be variables (Keras variables, "
                             "or tf.Variables on TensorFlow).")
        # id -> variable: matched by identity, and kept alive.
        self._local = {id(v): v for v in local_variables}

    def _global(self, variables):
        # Sharded weights (kerasdist.shard_weights) start from the root's
        # already, and each rank holds its own shard.
        return [v for v in _optimizer.replicated(variables)
                if id(v) not in self._local]

    def on_train_begin(self, logs=None):
        size = basics.size()
        if not isinstance(self.root_rank, int) or not (
                0 <= self.root_rank < size):
            raise ValueError(f"root_rank must be an int in [0, {size}), got "
                             f"{self.root_rank!r}.")
        self._pending = not _util.model_is_built(self.model)
        if not self._pending:
            self._broadcast()

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            _util.say_if_not_distributed(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self._pending:
            self._pending = False
            self._broadcast()

    def on_epoch_end(self, epoch, logs=None):
        if self.verify and not self._pending:
            variables = self._global(self.model.trainable_weights)
            # The optimizer's slots for local variables differ between
            # ranks by design: with local variables only weights count.
            if self.model.optimizer is not None and not self._local:
                variables += _optimizer.whole_variables(
                    self.model.optimizer)
            _util.verify_identical(variables, f"end of epoch {epoch}")

    def _broadcast(self):
        _util.build_optimizer(self.model)
        variables = self._global(_util.state_variables(self.model))
        # Names come from positions and shapes, not from variable paths:
        # auto-generated layer names ("dense_3") may differ between ranks
        # that built a different number of layers before this model.
        names = [f"kerasdist.bgv.{i}." + "x".join(str(d) for d in v.shape)
                 for i, v in enumerate(variables)]
        _framework.get().assign_broadcast(variables, self.root_rank, names)
        if self.verify:
            _util.verify_identical(variables, "after the broadcast")


def _is_variable(v):
    return hasattr(v, "assign") and hasattr(v, "shape")
