"""The Keras layer on the Keras backend that KERAS_BACKEND names
(tensorflow, jax or torch), under `kerasdist run -np N` (N >= 2):

    KERAS_BACKEND=jax python -m kerasdist.run -np 2 python \
        tests/workers/keras_backend_worker.py DIR [--only CHECK,...]

Named checks (tests/support/checks.py), grouped by the backends they run
on; a failure raises (non-zero exit). Truths are independent of kerasdist:
the plain Keras optimizer on one process over the concatenated batch,
closed-form averages and learning rates, every rank's raw values gathered.

Float32, the backends' default. The distributed step averages N per-rank
mean gradients where the truth takes one mean over the global batch: the
same sum in another order, a relative difference of about 1e-7 per step.
After 12 steps the weights (of order 1) agree to well under ATOL = 1e-5,
while training without averaging misses by more than 100 * ATOL (checked).
"""

import functools
import importlib
import os
import sys
import warnings

import keras
import numpy as np

import kerasdist as kd
from tests.support import checks
from tests.support.checks import check

BACKEND = keras.backend.backend()
# The collectives on this backend's tensors (for the checks' own gathers).
FRONT = importlib.import_module(
    {"tensorflow": "kerasdist", "jax": "kerasdist.jax",
     "torch": "kerasdist.torch"}[BACKEND])
kd.init()
R, N = kd.rank(), kd.size()
B = 4          # per-rank batch
STEPS = 12     # optimizer steps per equivalence check
ATOL = 1e-5    # see the module docstring
DIR = sys.argv[1]
_seq = [0]


def gather(value):
    """[N, ...] numpy array of every rank's `value`."""
    _seq[0] += 1
    a = np.asarray(value)
    out = FRONT.allgather(a.reshape((1,) + a.shape),
                          name=f"test.gather.{_seq[0]}")
    return np.asarray(keras.ops.convert_to_numpy(out))


def flat(arrays):
    return np.concatenate([np.ravel(np.asarray(a, np.float64))
                           for a in arrays])


def same_on_all_ranks(arrays, what):
    # float32 holds every value exactly (weights, small step counts) and
    # travels on every backend (JAX without x64 has no float64).
    table = gather(flat(arrays).astype(np.float32))
    for r in range(N):
        np.testing.assert_array_equal(table[r], table[0],
                                      err_msg=f"{what}: rank {r} differs")


def data(n_feat=4, seed=0):
    rng = np.random.default_rng(seed)
    n = N * B * STEPS
    x = rng.normal(size=(n, n_feat)).astype("float32")
    y = (x @ rng.normal(size=(n_feat, 1))
         + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def my_part(a):
    """Rank r's share: rows r*B..(r+1)*B of every global batch of N*B."""
    g = a.reshape(STEPS, N, B, *a.shape[1:])
    return g[:, R].reshape(STEPS * B, *a.shape[1:])


def seeded(model, seed, scale=0.5):
    """`model` with normal(0, scale) weights from `seed`, alike on every
    rank and backend."""
    rng = np.random.default_rng(seed)
    model.set_weights([(rng.normal(size=w.shape) * scale).astype("float32")
                       for w in model.get_weights()])
    return model


def dense_model(seed=1):
    return seeded(keras.Sequential([keras.Input((4,)),
                                    keras.layers.Dense(3, activation="tanh"),
                                    keras.layers.Dense(1)]), seed)


def fit(model, opt, x, y, batch, callbacks=(), **compile_args):
    model.compile(optimizer=opt, loss="mse", **compile_args)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model.get_weights()


def truth_fit(model, opt, x, y, batch):
    """One process's fit without kerasdist, a truth to compare with. On
    TensorFlow it runs eagerly: tracing a step costs more CPU than the few
    small steps it runs, and the weights agree with a traced fit's to well
    within ATOL. (JAX's eager ops cost more than its one compile; PyTorch
    runs eagerly anyway.)"""
    return fit(model, opt, x, y, batch,
               run_eagerly=keras.backend.backend() == "tensorflow")


def assert_close(got, truth, what, atol=ATOL):
    diff = np.max(np.abs(flat(got) - flat(truth)))
    assert diff <= atol, f"{what}: max abs diff {diff} > {atol}"
    return diff


# ---- DistributedOptimizer ----------------------------------------------------

# The checks below run on every backend unless they name theirs.
checks.group("tensorflow", "jax", "torch")


@check("apply_averages")
def check_apply_averages():
    """One apply with rank-dependent gradients: SGD(1) moves the weights by
    minus the average gradient, (N + 1) / 2, on every rank."""
    v = keras.Variable(np.zeros((2, 3), "float32"))
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.build([v])
    opt.apply([keras.ops.full((2, 3), float(R + 1))], [v])
    got = keras.ops.convert_to_numpy(v)
    np.testing.assert_array_equal(got, np.full((2, 3), -(N + 1) / 2.0))


def check_fit(label, make_opt, atol=ATOL, **kd_args):
    """Distributed fit on my part == single-process fit on everything."""
    x, y = data()
    truth = truth_fit(dense_model(), make_opt(), x, y, N * B)
    got = fit(dense_model(), kd.DistributedOptimizer(make_opt(), **kd_args),
              my_part(x), my_part(y), B)
    diff = assert_close(got, truth, label, atol)
    same_on_all_ranks(got, label)
    # The truth moved, and training without averaging ends elsewhere: a
    # wrapper that skipped the average would fail the comparison above.
    assert np.max(np.abs(flat(truth) - flat(dense_model().get_weights()))) \
        > 100 * atol, f"{label}: the truth did not train"
    alone = truth_fit(dense_model(), make_opt(), my_part(x), my_part(y), B)
    miss = np.max(np.abs(flat(alone) - flat(truth)))
    assert miss > 100 * atol, f"{label}: unaveraged training is too close"
    print(f"{label}: max diff {diff:.2e}, unaveraged {miss:.2e}", flush=True)
    return got


@check("fit_sgd_momentum")
def fit_sgd_momentum():
    check_fit("fit_sgd_momentum",
              lambda: keras.optimizers.SGD(0.05, momentum=0.9))


@check("fit_adam")
def fit_adam():
    check_fit("fit_adam", lambda: keras.optimizers.Adam(0.01))


@check("fit_num_groups_3")
def fit_num_groups_3():
    check_fit("fit_num_groups=3", lambda: keras.optimizers.Adam(0.01),
              num_groups=3)


@check("fit_predivide")
def fit_predivide():
    check_fit("fit_predivide", lambda: keras.optimizers.SGD(0.1),
              gradient_predivide_factor=float(N))


@functools.cache
def sgd_exact():
    """fit_sgd's weights, the reference of fit_fp16 (checked once)."""
    return check_fit("fit_sgd", lambda: keras.optimizers.SGD(0.1))


@check("fit_sgd")
def fit_sgd():
    sgd_exact()


@check("fit_compression_fp16")
def fit_fp16():
    # fp16 on the wire: 11-bit significands; 12 SGD steps of lr 0.1 move
    # weights of order 1 by up to ~1e-3 from the float32 result.
    x, y = data()
    exact = sgd_exact()
    got = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), compression=kd.Compression.fp16),
        my_part(x), my_part(y), B)
    assert_close(got, exact, "fit_fp16", atol=2e-3)
    assert not np.array_equal(flat(got), flat(exact)), "not compressed"
    same_on_all_ranks(got, "fit_fp16")


@check("fit_adam_eager", groups=("jax",))
def fit_adam_eager():
    # The jitted step is the default on JAX: also eagerly.
    x, y = data()
    truth = truth_fit(dense_model(), keras.optimizers.Adam(0.01), x, y,
                      N * B)
    got = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01)), my_part(x), my_part(y), B,
        jit_compile=False)
    assert_close(got, truth, "fit_adam_eager")


@check("fit_gradient_accumulation")
def fit_gradient_accumulation():
    # Keras' own accumulation (JAX's and PyTorch's stand-in for
    # backward_passes_per_step): averaged at every backward pass, the same
    # as one process accumulating the global batches.
    check_fit("fit_gradient_accumulation", lambda: keras.optimizers.SGD(
        0.1, momentum=0.5, gradient_accumulation_steps=3))


@check("accumulation_error", groups=("jax", "torch"))
def accumulation_error():
    try:
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                backward_passes_per_step=2)
    except ValueError as e:
        assert "gradient_accumulation_steps" in str(e), e
    else:
        raise AssertionError("backward_passes_per_step=2 accepted")


# ---- callbacks ---------------------------------------------------------------


@check("broadcast_global_variables")
def check_broadcast():
    """Ranks start from different weights; with lr 0 every rank ends with
    the root's initial weights, and the optimizer state agrees."""
    x, y = data()
    model = dense_model(seed=100 + R)
    initial = [gather(w)[N - 1] for w in model.get_weights()]
    assert not np.array_equal(gather(model.get_weights()[0])[0], initial[0])
    fit(model, kd.DistributedOptimizer(keras.optimizers.SGD(0.0)),
        my_part(x), my_part(y), B,
        [kd.callbacks.BroadcastGlobalVariablesCallback(N - 1, verify=True)])
    for w, expected in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(w, expected)
    same_on_all_ranks([keras.ops.convert_to_numpy(v)
                       for v in model.optimizer.variables], "bcast.opt")


class _Record(keras.callbacks.Callback):
    """Keeps copies of the logs and the learning rate after every batch."""

    def __init__(self):
        super().__init__()
        self.epoch_logs, self.lrs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(
            self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs or {}))


@functools.cache
def metric_average_and_warmup_run():
    """One fit with MetricAverageCallback and LearningRateWarmupCallback,
    recording the logs and learning rates before and after them."""
    x, y = data()
    raw, after = _Record(), _Record()
    lr, warmup = 0.05 * N, 2
    model = dense_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(lr)), "mse",
                  metrics=["mae"])
    model.fit(my_part(x), my_part(y), batch_size=B, epochs=3, shuffle=False,
              verbose=0, callbacks=[
                  raw, kd.callbacks.MetricAverageCallback(),
                  kd.callbacks.LearningRateWarmupCallback(
                      lr, warmup_epochs=warmup), after])
    return raw, after, lr, warmup


@check("metric_average")
def check_metric_average():
    raw, after, _, _ = metric_average_and_warmup_run()
    for e, (mine, averaged) in enumerate(zip(raw.epoch_logs,
                                             after.epoch_logs)):
        for key in ("loss", "mae"):
            # The logged values are float32 numbers: exact in the gather.
            expected = gather(np.float32(mine[key])).astype(np.float64).mean()
            assert abs(averaged[key] - expected) <= 1e-12 * max(
                1.0, abs(expected)), (e, key, averaged[key], expected)
    same_on_all_ranks([[l["loss"] for l in after.epoch_logs]], "metrics")


@check("learning_rate_warmup")
def check_lr_warmup():
    _, after, lr, warmup = metric_average_and_warmup_run()
    # Horovod's warmup, before batch b of epoch e (12 batches an epoch):
    # lr / N * (epoch * (N - 1) / warmup + 1), epoch = e + (b + 1) / 12.
    batches = STEPS
    expected = []
    for e in range(3):
        for b in range(batches):
            if e < warmup:
                t = e + (b + 1) / batches
                expected.append(lr / N * (t * (N - 1) / warmup + 1))
            else:
                expected.append(expected[-1])
    # Read back from the model after each step: on JAX from the state the
    # step ran with, so a rate the step did not see would show here.
    np.testing.assert_allclose(after.lrs, expected, rtol=1e-6)


@check("model_average")
def check_model_average():
    """ModelAverageCallback(1) with plain SGD (no momentum) equals
    synchronous training: the average of the ranks' updated weights is the
    update by the average gradient."""
    x, y = data()
    truth = fit(dense_model(), keras.optimizers.SGD(0.1), x, y, N * B)
    got = fit(dense_model(), keras.optimizers.SGD(0.1), my_part(x),
              my_part(y), B,
              [kd.callbacks.ModelAverageCallback(every_n_batches=1)])
    assert_close(got, truth, "model_average")
    same_on_all_ranks(got, "model_average")


@functools.cache
def uneven_checkpointed_fit():
    """A fit on uneven shards (9 examples on 2 ranks: 5 and 4, so 3 and 2
    batches of 2) with EqualizeStepsCallback and a rank-0 ModelCheckpoint:
    (model, rank 0's checkpoint directory)."""
    x, y = data()
    x, y = x[:4 * N + 1], y[:4 * N + 1]
    xs, ys = kd.data.shard((x, y))
    mine = os.path.join(DIR, f"rank{R}", "ckpt")
    path = os.path.join(mine, "epoch{epoch}.weights.h5")
    model = dense_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  "mse")
    model.fit(xs, ys, batch_size=2, epochs=2, shuffle=False, verbose=0,
              callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0),
                         kd.callbacks.EqualizeStepsCallback(),
                         kd.callbacks.ModelCheckpoint(path)])
    return model, mine


@check("equalize_steps")
def check_equalize_steps():
    """Uneven shards end every epoch after 2 steps everywhere."""
    model, _ = uneven_checkpointed_fit()
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 4
    same_on_all_ranks(model.get_weights(), "uneven")


@check("model_checkpoint_latest_checkpoint_load_checkpoint")
def check_checkpoint():
    """Rank 0 alone writes the checkpoint; it restores weights and the
    optimizer's state."""
    model, mine = uneven_checkpointed_fit()
    if R == 0:
        files = sorted(os.listdir(mine))
        assert files == ["epoch1.weights.h5", "epoch2.weights.h5"], files
    else:
        assert not os.path.exists(mine), f"rank {R} wrote {mine}"
    fresh = dense_model(seed=7)
    fresh.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  "mse")
    epoch = kd.callbacks.load_checkpoint(kd.callbacks.latest_checkpoint(
        os.path.join(DIR, "rank0", "ckpt")), fresh)
    assert epoch == 2, epoch
    np.testing.assert_array_equal(flat(fresh.get_weights()),
                                  flat(model.get_weights()))
    np.testing.assert_array_equal(
        flat([keras.ops.convert_to_numpy(v)
              for v in fresh.optimizer.variables]),
        flat([keras.ops.convert_to_numpy(v)
              for v in model.optimizer.variables]))


class _SlowRankZero(keras.callbacks.Callback):
    """Rank 0 reaches each epoch's checkpoint late: a rank that returned
    from fit without waiting would read the previous epoch's file."""

    def on_epoch_end(self, epoch, logs=None):
        if R == 0:
            import time
            time.sleep(1.5)


@check("every_rank_loads_rank0_model_after_fit")
def check_every_rank_loads_rank0_model():
    """The FordA pattern: save the model on rank 0, load it on every rank
    right after fit. kd.callbacks.ModelCheckpoint('.keras') makes fit end
    only once the file is complete; kd.load_model(root_rank=0) reads
    rank 0's file (written by Keras' own callback on rank 0) on rank 0
    only and sends it to the others."""
    x, y = data()
    xs, ys = my_part(x), my_part(y)
    shared = os.path.join(DIR, "shared", "last.keras")
    private = os.path.join(DIR, f"rank{R}", "private", "best.keras")
    callbacks = [kd.callbacks.BroadcastGlobalVariablesCallback(0),
                 _SlowRankZero(),
                 kd.callbacks.ModelCheckpoint(shared, monitor="loss")]
    if R == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(private))
    model = dense_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  "mse")
    model.fit(xs, ys, batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=callbacks)
    trained = flat(model.get_weights())
    loaded = keras.models.load_model(shared)
    np.testing.assert_array_equal(flat(loaded.get_weights()), trained)
    if R != 0:
        assert not os.path.exists(private), private
    loaded = kd.load_model(private, root_rank=0)
    np.testing.assert_array_equal(flat(loaded.get_weights()), trained)
    assert loaded.optimizer._kerasdist_settings is not None
    try:
        kd.load_model(os.path.join(DIR, "missing.keras"), root_rank=0)
    except OSError as e:
        assert "rank 0 could not read the file" in str(e), e
    else:
        raise AssertionError("load_model of a missing file did not raise")


# ---- gradient buckets (overlap) ---------------------------------------------

# dense_model's gradients in backprop order are bias 1 (4 bytes), kernel 1
# (12), bias 0 (12), kernel 0 (48): 16-byte buckets make three, in the
# variables' indices [[3, 2], [1], [0]].
TINY_BUCKETS = {"overlap": True, "bucket_bytes": 16}


@check("fit_overlap_buckets", groups=("jax", "torch"))
def fit_overlap_buckets():
    """Three buckets (three allreduces, on PyTorch started from autograd
    hooks, on JAX three custom calls) == one process on the global batch
    == the synchronous reduction (overlap=False)."""
    x, y = data()
    got = check_fit("fit_overlap_buckets",
                    lambda: keras.optimizers.Adam(0.01), **TINY_BUCKETS)
    off = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), overlap=False), my_part(x), my_part(y),
        B)
    assert_close(got, off, "overlap on vs off", atol=1e-6)
    if keras.backend.backend() == "torch":
        # torch.compile's step: the optimizer's apply and the hooks
        # (reducing in place) run outside the compiled code.
        jit = fit(dense_model(), kd.DistributedOptimizer(
            keras.optimizers.Adam(0.01), **TINY_BUCKETS), my_part(x),
            my_part(y), B, jit_compile=True)
        assert_close(jit, off, "overlap: jit_compile", atol=1e-5)


@check("overlap_starts_before_backprop_ends", groups=("torch",))
def overlap_starts_before_backprop_ends():
    """In `fit`'s last step, bucket 0's allreduce was enqueued from its
    hook before backprop had produced the last gradient (an order record,
    not a timing), and apply took every bucket from the hooks."""
    x, y = data()
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), **TINY_BUCKETS)
    fit(dense_model(), opt, my_part(x), my_part(y), B)
    b = opt._kerasdist_overlap.buckets
    assert b is not None, "no hooks installed"
    assert b.buckets == [[3, 2], [1], [0]], b.buckets
    ev = b.last_events
    assert ev[-1] == ("collect", ()), ev
    assert sorted(e for e in ev if e[0] == "grad") == [
        ("grad", i) for i in range(4)], ev
    assert [e for e in ev if e[0] == "start"] == [
        ("start", k) for k in range(3)], ev
    last_grad = max(i for i, e in enumerate(ev) if e[0] == "grad")
    assert ev.index(("start", 0)) < last_grad, ev
    # Each bucket starts right after its own last gradient.
    for k, members in enumerate(b.buckets):
        ready = max(ev.index(("grad", i)) for i in members)
        assert ev.index(("start", k)) == ready + 1, (k, ev)
    # The first step (backward before the hooks existed) goes through the
    # same buckets, started once it has installed them.
    first = kd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                    **TINY_BUCKETS)
    fit(dense_model(), first, my_part(x)[:B], my_part(y)[:B], B)
    ev = first._kerasdist_overlap.buckets.last_events
    assert len([e for e in ev if e[0] == "start"]) == 3, ev
    assert ev[-1] == ("collect", ()), ev
    # overlap=False: no hooks.
    plain = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), overlap=False)
    fit(dense_model(), plain, my_part(x), my_part(y), B)
    assert plain._kerasdist_overlap.buckets is None


def torch_loop(opt, model, extra, x, y, twice=False):
    """A custom loop: backward, then apply with the variables' `.grad`
    (`extra`'s layer takes no part in the loss: None gradients)."""
    import warnings

    import torch
    variables = model.trainable_variables + extra.trainable_variables
    # Keras warns of the None gradients at every apply.
    warnings.filterwarnings("ignore", "Gradients do not exist")
    for s in range(STEPS):
        xb = torch.as_tensor(x[s * B:(s + 1) * B])
        yb = torch.as_tensor(y[s * B:(s + 1) * B])
        for v in variables:
            v.value.grad = None
        for _ in range(2 if twice else 1):  # twice: .grad accumulates
            loss = torch.mean((model(xb) - yb) ** 2)
            loss.backward()
        opt.apply([v.value.grad for v in variables], variables)
    return [keras.ops.convert_to_numpy(v) for v in variables]


@check("overlap_custom_loop_local_none", groups=("torch",))
def overlap_custom_loop_local_none():
    """A custom loop with a local variable (register_local_var), None
    gradients and, in a second run, two backward passes per apply: the
    buckets give the synchronous path's result (itself checked against one
    process above); the None and local gradients are in no bucket, and a
    second backward pass sends the buckets through the synchronous path."""
    x, y = data()
    x, y = my_part(x), my_part(y)

    def run(overlap, twice=False):
        model = dense_model()
        extra = keras.layers.Dense(2)
        extra.build((None, 4))
        extra.set_weights([np.ones((4, 2), "float32"),
                           np.zeros(2, "float32")])
        opt = kd.DistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.5), overlap=overlap,
            bucket_bytes=16)
        opt.register_local_var(model.layers[-1].bias)
        return torch_loop(opt, model, extra, x, y, twice), opt

    off, _ = run(False)
    on, opt = run(True)
    assert_close(on, off, "custom loop: overlap on vs off", atol=1e-6)
    b = opt._kerasdist_overlap.buckets
    # Reduced: kernel 0, bias 0, kernel 1 (bias 1 is local, extra's None).
    assert b is not None and b.where == [0, 1, 2], b and b.where
    assert b.last_events[-1] == ("collect", ()), b.last_events
    assert any(e[0] == "start" for e in b.last_events), b.last_events
    off2, _ = run(False, twice=True)
    on2, opt2 = run(True, twice=True)
    assert_close(on2, off2, "two backward passes: overlap on vs off",
                 atol=1e-6)
    redo = opt2._kerasdist_overlap.buckets.last_events[-1]
    assert redo == ("collect", (0, 1, 2)), redo
    same_on_all_ranks(on[:3] + on[4:], "custom loop")


@check("overlap_grads_averaged_in_place", groups=("torch",))
def overlap_grads_averaged_in_place():
    """Once the hooks are installed (at the first apply), `backward()`
    returns with every `.grad` holding the average over the ranks, in the
    same tensor, as with DDP (the hooks' allreduces write into it, and
    backward waits for them); `apply` takes them as they are (nothing
    left to reduce). With op=Sum the hooks reduce out of place and `.grad`
    stays this rank's own."""
    import torch
    x, y = data()
    x, y = my_part(x), my_part(y)
    for op, averaged in ((kd.Average, True), (kd.Sum, False)):
        model = dense_model()
        opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=op,
                                      **TINY_BUCKETS)
        variables = model.trainable_variables
        params = [v.value for v in variables]
        for s in range(2):
            xb = torch.as_tensor(x[s * B:(s + 1) * B])
            yb = torch.as_tensor(y[s * B:(s + 1) * B])
            for p in params:
                p.grad = None
            loss = torch.mean((model(xb) - yb) ** 2)
            local = [g.clone() for g in torch.autograd.grad(
                loss, params, retain_graph=True)]
            loss.backward()
            grads = [p.grad for p in params]
            if s == 1:
                for i, (g, mine) in enumerate(zip(grads, local)):
                    want = (kd.allreduce(mine, op=kd.Average,
                                         name=f"in_place.{i}")
                            if averaged else mine)
                    assert_close(g.numpy(), want.numpy(),
                                 f".grad {i} after backward, op {op}",
                                 atol=1e-6)
            opt.apply(grads, variables)
        b = opt._kerasdist_overlap.buckets
        assert b.inplace is averaged, (op, b.inplace)
        assert b.last_events[-1] == ("collect", ()), b.last_events


@check("overlap_process_set_of_one", groups=("torch",))
def overlap_process_set_of_one():
    """A set of rank 0 alone: rank 0 reduces over itself, rank 1 is
    outside; neither installs hooks, and each trains on its own data as
    the plain optimizer does."""
    ps = kd.add_process_set([0])
    try:
        x, y = data()
        opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                      process_set=ps, **TINY_BUCKETS)
        got = fit(dense_model(), opt, my_part(x), my_part(y), B)
        alone = fit(dense_model(), keras.optimizers.SGD(0.1), my_part(x),
                    my_part(y), B)
        assert_close(got, alone, "process set of one", atol=1e-6)
        assert opt._kerasdist_overlap.buckets is None
    finally:
        kd.remove_process_set(ps)


@check("jax_bucket_custom_calls", groups=("jax",))
def jax_bucket_custom_calls():
    """Inside jax.jit, one grouped-allreduce custom call per bucket, each
    taking only its bucket's gradients; num_groups and overlap=False keep
    their calls."""
    import jax
    import jax.numpy as jnp

    from kerasdist.keras import reduction as _reduction
    shapes = [(4, 3), (3,), (3, 1), (1,)]  # dense_model's

    def count(**kw):
        def step(*gs):
            return _reduction.reduce_gradients(
                list(gs), None, "test.bk", **kw)
        text = jax.jit(step).lower(
            *[jnp.ones(s, jnp.float32) for s in shapes]).as_text()
        return text.count("kerasdist_grouped_allreduce"), text

    n, text = count(bucket_bytes=16)
    assert n == 3, text
    for k in range(3):
        assert f"test.bk.bucket{k}of3" in text, text
    assert count()[0] == 1
    assert count(num_groups=2)[0] == 2
    assert count(num_groups=2, bucket_bytes=16)[0] == 2


@check("no_tensorflow", groups=("jax", "torch"))
def no_tensorflow():
    # Keras itself imports TensorFlow when it is installed in
    # keras.utils.set_random_seed and LossScaleOptimizer.get_config
    # (hence that check last); kerasdist never does on JAX or PyTorch.
    assert "tensorflow" not in sys.modules, "TensorFlow was imported"


@check("fit_loss_scale")
def fit_loss_scale():
    check_fit("fit_loss_scale", lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**10))


# ---- the sharded optimizer (shard=) ------------------------------------------

checks.group("tensorflow", "jax", "torch")


def check_shard(label, make_opt, shard="optimizer_state", model=dense_model,
                x_y=None, atol=ATOL, unlike=None, wrap=lambda o: o,
                replicated=False, **kd_args):
    """Sharded fit on my part == one process on everything (and, with
    `replicated`, == the replicated DistributedOptimizer); the weights
    agree bit for bit on every rank, and the optimizer's slots hold 1/N of
    each variable. `unlike`: an optimizer whose truth must differ (the same
    without clipping). Training without the average misses these truths
    by far more than ATOL: check_fit shows it for the same data."""
    x, y = x_y or data()
    truth = truth_fit(model(), make_opt(), x, y, N * B)
    if unlike is not None:
        other = truth_fit(model(), unlike(), x, y, N * B)
        assert np.max(np.abs(flat(other) - flat(truth))) > 100 * atol, \
            f"{label}: the option made no difference"
    opt = kd.DistributedOptimizer(make_opt(), shard=shard, **kd_args)
    sharded = opt
    opt = wrap(opt)
    # As users run it: the start broadcast from rank 0, and every epoch's
    # check that the weights and the shared optimizer state agree.
    got = fit(model(), opt, my_part(x), my_part(y), B, [
        kd.callbacks.BroadcastGlobalVariablesCallback(0, verify=True)])
    diff = assert_close(got, truth, label, atol)
    same_on_all_ranks(got, label)
    assert np.max(np.abs(flat(truth) - flat(model().get_weights()))) \
        > 100 * atol, f"{label}: the truth did not train"
    if replicated:
        other = fit(model(), wrap(kd.DistributedOptimizer(make_opt(),
                                                          **kd_args)),
                    my_part(x), my_part(y), B)
        assert_close(got, other, f"{label}: against replicated", atol)
    sizes = [int(np.prod(v.shape))
             for v in sharded.kerasdist_sharded_variables]
    whole = sum(int(np.prod(w.shape)) for w in got)
    slots = len(sizes) // max(1, len(got))
    assert sum(sizes) <= slots * (whole / N + len(got)), (sizes, whole)
    print(f"{label}: max diff {diff:.2e}, slots {sizes}", flush=True)
    return got


@check("overlap_process_set_np3", groups=("torch_np3",))
def overlap_process_set_np3():
    """On a process set of two of the three ranks (an id of its own), the
    replicated optimizer's in-place buckets and the sharded one's backprop
    reduce-scatters (written into rows of their own) train as one process
    on the pair's batch of 2 B; rank 2 only takes part in making the
    set."""
    pair = kd.add_process_set([0, 1])
    try:
        if R > 1:
            # The pair's three models, built here too: Keras' automatic
            # layer names, which later checks' collectives carry, stay
            # the same on every rank.
            for _ in range(3):
                dense_model()
            return
        x, y = data()
        n = 2 * B * STEPS
        x, y = x[:n], y[:n]
        sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.5)  # noqa: E731
        truth = truth_fit(dense_model(), sgd(), x, y, 2 * B)
        mine = x.reshape(STEPS, 2, B, -1)[:, R].reshape(STEPS * B, -1)
        ys = y.reshape(STEPS, 2, B, -1)[:, R].reshape(STEPS * B, -1)
        for shard in (None, "gradients"):
            opt = kd.DistributedOptimizer(sgd(), shard=shard,
                                          process_set=pair, **TINY_BUCKETS)
            got = fit(dense_model(), opt, mine, ys, B)
            assert_close(got, truth, f"process set of two, shard={shard}")
            hooks = (opt._kerasdist_overlap.buckets if shard is None
                     else opt._kerasdist_overlap.shards)
            assert hooks is not None and hooks.last_events[-1][0] == (
                "collect"), shard
    finally:
        kd.remove_process_set(pair)


@check("shard_fit_sgd_momentum")
@check("shard_fit_sgd_momentum_np3", groups=("jax_np3", "torch_np3"))
def shard_fit_sgd_momentum():
    check_shard("shard_fit_sgd_momentum",
                lambda: keras.optimizers.SGD(0.05, momentum=0.9))


@check("shard_fit_adam")
@check("shard_fit_adam_np3", groups=("jax_np3", "torch_np3"))
def shard_fit_adam():
    check_shard("shard_fit_adam", lambda: keras.optimizers.Adam(0.01))


def wide_model(seed=1):
    # A 256 x 256 kernel: its shards are over _shard_step.ALONE_BYTES, so it
    # is reduced and gathered alone; the rest share a bucket.
    return seeded(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(256, activation="tanh"),
        keras.layers.Dense(256, activation="tanh"), keras.layers.Dense(1)]),
        seed, scale=0.1)


@check("shard_fit_adam_large_and_small_shards")
def shard_fit_adam_large_and_small_shards():
    from kerasdist.keras.sharding import step as _shard_step
    assert 256 * 256 // N * 4 >= _shard_step.ALONE_BYTES
    check_shard("shard_fit_adam_large_and_small_shards",
                lambda: keras.optimizers.Adam(0.001), model=wide_model)


def deep_wide_model(seed=1):
    # Three 256 x 256 kernels, each reduced alone (wide_model's note).
    return seeded(keras.Sequential([keras.Input((4,))] + [
        keras.layers.Dense(256, activation="tanh") for _ in range(4)] + [
        keras.layers.Dense(1)]), seed, scale=0.1)


@check("shard_backprop_paced", groups=("tensorflow",))
def shard_backprop_paced():
    # In model.fit's graph TensorFlow runs every ready op, so backprop
    # would make every whole gradient before the first reduce-scatter
    # ends: each gradient reduced alone waits for the reduce-scatters
    # that leave at most IN_FLIGHT_BYTES before it (here none: each waits
    # for the one before). It trains as one process in fit, and a
    # tf.function loop's graph has the waits (each large kernel's
    # gradient after the reduce-scatter before it).
    import tensorflow as tf

    from kerasdist.keras.sharding import step as _shard_step

    was = _shard_step.IN_FLIGHT_BYTES
    _shard_step.IN_FLIGHT_BYTES = 0
    try:
        for mode in ("gradients", "optimizer_state"):
            check_shard(f"shard_backprop_paced_{mode}",
                        lambda: keras.optimizers.Adam(0.001), shard=mode,
                        model=deep_wide_model)
        x, y = data()
        m = deep_wide_model()
        opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                      shard="gradients")

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(m(xb) - yb))
            opt.apply(tape.gradient(loss, m.trainable_variables),
                      m.trainable_variables)

        step(my_part(x)[:B], my_part(y)[:B])
        graph = step.get_concrete_function(x[:B], y[:B]).graph
        waits = [op for op in graph.get_operations()
                 if any(c.type == "KerasdistReducescatter"
                        for c in op.control_inputs)]
        # The three large kernels: the second and third in backprop
        # order wait.
        assert [op.type for op in waits] == ["MatMul"] * 2, \
            [(op.type, op.name) for op in waits]
    finally:
        _shard_step.IN_FLIGHT_BYTES = was


# Options whose sharded path is the same code on every backend: checked
# on TensorFlow (the backends' own paths are checked above and below).
@check("shard_fit_accumulation_predivide_fp16", groups=("tensorflow",))
def shard_fit_accumulation_predivide_fp16():
    check_shard("shard_fit_gradient_accumulation",
                lambda: keras.optimizers.SGD(
                    0.1, momentum=0.5, gradient_accumulation_steps=3))
    check_shard("shard_fit_predivide", lambda: keras.optimizers.SGD(0.1),
                gradient_predivide_factor=float(N))
    # fp16 on the wire for the gradients (the weights travel whole): the
    # replicated optimizer's rounding, within fp16's 11 bits of float32.
    x, y = data()
    fp16 = kd.Compression.fp16
    got = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), shard="gradients", compression=fp16),
        my_part(x), my_part(y), B)
    replicated = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), compression=fp16), my_part(x),
        my_part(y), B)
    assert_close(got, replicated, "shard fp16 against replicated fp16")
    assert_close(got, sgd_exact(), "shard fp16 against float32", 2e-3)
    same_on_all_ranks(got, "shard fp16")


@check("shard_backward_passes_per_step", groups=("tensorflow",))
def shard_backward_passes_per_step():
    # Two local passes summed, then one sharded step: the replicated
    # optimizer's result, and one process on batches of 2 N B.
    x, y = data()
    got = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), shard="optimizer_state",
        backward_passes_per_step=2, average_aggregated_gradients=True),
        my_part(x), my_part(y), B)
    replicated = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), backward_passes_per_step=2,
        average_aggregated_gradients=True), my_part(x), my_part(y), B)
    assert_close(got, replicated, "shard backward_passes_per_step=2")
    assert np.max(np.abs(flat(got) - flat(dense_model().get_weights()))) \
        > 100 * ATOL, "did not train"
    same_on_all_ranks(got, "shard backward_passes_per_step")


@check("shard_fit_adamw_global_clipnorm")
@check("shard_fit_adamw_global_clipnorm_np3", groups=("jax_np3", "torch_np3"))
def shard_fit_adamw_global_clipnorm():
    # A clip norm small enough to clip every step: the norm must be the
    # whole gradient's, summed over the ranks' shards.
    check_shard("shard_fit_adamw_global_clipnorm",
                lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1,
                                               global_clipnorm=0.05),
                unlike=lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1))


@check("shard_fit_clipnorm_clipvalue_gradients_buckets",
       groups=("tensorflow",))
def shard_fit_clipnorm_clipvalue_gradients_buckets():
    # ZeRO-2 in three buckets; clipnorm is per variable, clipvalue per
    # element (of the averaged gradient, so on the shards).
    check_shard("shard_fit_clipnorm_gradients_buckets",
                lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
                shard="gradients", replicated=True,
                unlike=lambda: keras.optimizers.Adam(0.01), **TINY_BUCKETS)
    check_shard("shard_fit_clipvalue",
                lambda: keras.optimizers.SGD(0.1, clipvalue=0.02),
                unlike=lambda: keras.optimizers.SGD(0.1))


def embedding_model(seed=1):
    return seeded(keras.Sequential([keras.Input((3,), dtype="int32"),
                                    keras.layers.Embedding(10, 4),
                                    keras.layers.Flatten(),
                                    keras.layers.Dense(1)]), seed)


def int_data():
    rng = np.random.default_rng(3)
    n = N * B * STEPS
    x = rng.integers(0, 10, size=(n, 3)).astype("int32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


@check("shard_fit_embedding")
@check("shard_fit_embedding_np3", groups=("jax_np3", "torch_np3"))
def shard_fit_embedding():
    # On TensorFlow the embedding's gradient is a tf.IndexedSlices, which
    # the sharded optimizer reduces dense (as sparse_as_dense=True). SGD
    # with momentum updates every row either way; Keras' TF Adam updates
    # its moments only at a tf.IndexedSlices' rows, so the sharded Adam
    # equals the replicated one with sparse_as_dense=True.
    check_shard("shard_fit_embedding",
                lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                model=embedding_model, x_y=int_data())
    if BACKEND != "tensorflow":
        return  # no tf.IndexedSlices
    x, y = int_data()
    got = fit(embedding_model(), kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), shard="gradients"), my_part(x),
        my_part(y), B)
    dense = fit(embedding_model(), kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), sparse_as_dense=True), my_part(x),
        my_part(y), B)
    assert_close(got, dense, "shard_fit_embedding: Adam")


@check("shard_fit_mixed_bfloat16")
@check("shard_fit_mixed_bfloat16_np3", groups=("jax_np3", "torch_np3"))
def shard_fit_mixed_bfloat16():
    # bfloat16 activations round differently on a batch of B than on one of
    # N * B: against one process 1e-2; against the replicated optimizer,
    # which reduces the same gradients, 1e-5.
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x, y = data()
        opt = kd.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                      shard="optimizer_state")
        got = fit(dense_model(), opt, my_part(x), my_part(y), B)
        truth = truth_fit(dense_model(), keras.optimizers.Adam(0.01), x, y,
                          N * B)
        replicated = fit(dense_model(), kd.DistributedOptimizer(
            keras.optimizers.Adam(0.01)), my_part(x), my_part(y), B)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_close(got, truth, "mixed_bfloat16: against one process", 1e-2)
    assert_close(got, replicated, "mixed_bfloat16: against replicated")
    same_on_all_ranks(got, "mixed_bfloat16")


@check("shard_fit_loss_scale_ema")
def shard_fit_loss_scale_ema():
    # A LossScaleOptimizer around the sharded one (its finiteness check
    # agreed over the ranks), and EMA kept on the shards and gathered at
    # the end of fit.
    check_shard("shard_fit_loss_scale",
                lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                wrap=lambda o: keras.optimizers.LossScaleOptimizer(
                    o, initial_scale=2.0**10))
    check_shard("shard_fit_ema",
                lambda: keras.optimizers.Adam(0.01, use_ema=True,
                                              ema_momentum=0.5))


# ---- sharded weights: kd.shard_weights + shard="weights" (ZeRO-3) ----------


def check_weights(label, make_opt, model=dense_model, x_y=None, atol=ATOL,
                  unlike=None, **shard_args):
    """Sharded weights' fit on my part == one process on everything; each
    rank holds 1/N of every weight (shards and slots), every rank reads
    the same whole weights, and a Keras user's reads (get_weights,
    predict, layer.kernel) see whole weights."""
    x, y = x_y or data()
    truth = truth_fit(model(), make_opt(), x, y, N * B)
    if unlike is not None:
        other = truth_fit(model(), unlike(), x, y, N * B)
        assert np.max(np.abs(flat(other) - flat(truth))) > 100 * atol, \
            f"{label}: the option made no difference"
    m = model()
    whole = sum(int(np.prod(w.shape)) for w in m.get_weights()
                if w.dtype.kind == "f")
    kd.shard_weights(m, **shard_args)
    opt = kd.DistributedOptimizer(make_opt(), shard="weights")
    got = fit(m, opt, my_part(x), my_part(y), B, [
        kd.callbacks.BroadcastGlobalVariablesCallback(0, verify=True)])
    diff = assert_close(got, truth, label, atol)
    same_on_all_ranks(got, label)
    held = sum(int(np.prod(v.shape)) for v in m.trainable_variables)
    assert held <= whole / N + len(m.trainable_variables), (held, whole)
    assert all(len(v.shape) == 1 for v in m.trainable_variables)
    slots = sum(int(np.prod(v.shape))
                for v in opt.kerasdist_sharded_variables)
    assert slots <= 2 * held, (slots, held)
    kernel = m.layers[-1].kernel
    assert tuple(kernel.shape) == got[-2].shape, kernel.shape
    np.testing.assert_array_equal(np.asarray(kernel.numpy()), got[-2])
    print(f"{label}: max diff {diff:.2e}, held {held} of {whole}",
          flush=True)
    return m, got


@check("weights_fit_adam")
@check("weights_fit_adam_np3", groups=("jax_np3", "torch_np3"))
def weights_fit_adam():
    m, got = check_weights("weights_fit_adam",
                           lambda: keras.optimizers.Adam(0.01))
    # predict on whole weights, as one process with the same weights.
    x, _ = data()
    plain = dense_model()
    plain.set_weights(got)
    np.testing.assert_allclose(m.predict(x[:8], verbose=0),
                               plain.predict(x[:8], verbose=0),
                               rtol=1e-6, atol=1e-6)
    # A whole file, written from the shards, that plain Keras loads.
    path = os.path.join(DIR, "weights_fit_adam.keras")
    kd.save_model(m, path)
    kd.barrier()
    loaded = keras.models.load_model(path)
    assert_close(loaded.get_weights(), got, "weights: the saved file", 0)
    assert int(loaded.optimizer.iterations) == STEPS, \
        int(loaded.optimizer.iterations)
    # kd.callbacks.ModelCheckpoint: every rank saves, rank 0 writes.
    ckpt = os.path.join(DIR, "weights_ckpt_{epoch}.keras")
    x, y = data()
    m.fit(my_part(x), my_part(y), batch_size=B, epochs=1, shuffle=False,
          verbose=0, callbacks=[kd.callbacks.ModelCheckpoint(ckpt)])
    now = m.get_weights()
    kd.barrier()
    assert_close(keras.models.load_model(ckpt.format(epoch=1))
                 .get_weights(), now, "weights: ModelCheckpoint", 0)
    # set_weights / load_weights take whole values into the shards.
    again = kd.shard_weights(dense_model(seed=5))
    again.set_weights(got)
    assert_close(again.get_weights(), got, "weights: set_weights", 0)
    again = kd.shard_weights(dense_model(seed=5))
    again.load_weights(path)  # a whole .keras file's weights
    assert_close(again.get_weights(), got, "weights: load_weights", 0)
    # What a Keras user reads of the model counts whole weights: the
    # parameters, the summary, evaluate's loss (one process's on them).
    assert m.count_params() == plain.count_params(), m.count_params()
    lines = []
    m.summary(print_fn=lambda line, **_: lines.append(line))
    text, whole = "".join(lines), plain.count_params()
    assert f"Trainable params: {whole:,} (" in text, text
    x, y = data()
    plain.set_weights(now)
    plain.compile(loss="mse")
    np.testing.assert_allclose(m.evaluate(x[:8], y[:8], verbose=0),
                               plain.evaluate(x[:8], y[:8], verbose=0),
                               rtol=1e-6)


@check("weights_fit_clipnorm_embedding")
def weights_fit_clipnorm_embedding():
    # The global norm is the whole gradient's, from every rank's shards.
    check_weights("weights_fit_adamw_global_clipnorm",
                  lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1,
                                                 global_clipnorm=0.05),
                  unlike=lambda: keras.optimizers.AdamW(0.01,
                                                        weight_decay=0.1))
    # An embedding table read by a gather (TensorFlow's gradient is a
    # tf.IndexedSlices, reduce-scattered dense).
    check_weights("weights_fit_embedding",
                  lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                  model=embedding_model, x_y=int_data())


def cnn_model(seed=1, norm=None):
    """Conv2D, BatchNormalization (SyncBatchNormalization in the sharded
    model: one process's batch statistics are the global batch's)."""
    keras.utils.set_random_seed(seed)
    norm = norm or keras.layers.BatchNormalization
    return keras.Sequential([
        keras.Input((5, 5, 2)), keras.layers.Conv2D(3, 3), norm(),
        keras.layers.Activation("relu"), keras.layers.Flatten(),
        keras.layers.Dense(1)])


def attention_model(seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 4))
    a = keras.layers.MultiHeadAttention(2, 2)(inputs, inputs)
    x = keras.layers.LayerNormalization()(inputs + a)
    x = keras.layers.Dense(6, activation="gelu")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def shaped_data(shape):
    rng = np.random.default_rng(4)
    n = N * B * STEPS
    x = rng.normal(size=(n,) + shape).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


@check("weights_fit_cnn_attention")
def weights_fit_cnn_attention():
    # SGD: Adam would turn round-off in the attention's key bias (whose
    # true gradient is zero) into full steps.
    x, y = shaped_data((5, 5, 2))
    truth = truth_fit(cnn_model(), keras.optimizers.SGD(0.1, momentum=0.5),
                      x, y, N * B)
    # remat=True: every layer gathers again for its backward, however
    # small (by default only layers of 1 MiB or more).
    m = kd.shard_weights(cnn_model(norm=kd.SyncBatchNormalization),
                         remat=True)
    got = fit(m, kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.5), shard="weights"),
        my_part(x), my_part(y), B)
    assert_close(got, truth, "weights: CNN with batch norm", 1e-4)
    same_on_all_ranks(got, "weights: CNN")
    check_weights("weights_fit_attention",
                  lambda: keras.optimizers.SGD(0.1), model=attention_model,
                  x_y=shaped_data((5, 4)), remat=True)


@check("weights_fit_units")
def weights_fit_units():
    # min_unit_bytes: layers smaller than it gather together when the
    # model's call begins (one allgather and one reduce-scatter a step for
    # all of them), not each at its own call; the same training either way.
    m, _ = check_weights("weights_fit_units",
                         lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                         min_unit_bytes=1 << 20)

    def gathers(call):
        return [getattr(call, f"_kerasdist_{k}", False)
                for k in ("unit", "grouped")]

    assert gathers(m.call) == [True, False], "the model gathers no unit"
    assert not [layer.name for layer in m.layers if any(gathers(layer.call))]
    # Sharded again (as after building under the context): the same unit,
    # no layer gathering its own again.
    unit = m.call
    kd.shard_weights(m, min_unit_bytes=1 << 20)
    assert m.call is unit
    assert not [layer.name for layer in m.layers if any(gathers(layer.call))]
    # With batch normalization (state it updates itself, left whole).
    x, y = shaped_data((5, 5, 2))
    truth = truth_fit(cnn_model(), keras.optimizers.SGD(0.1, momentum=0.5),
                      x, y, N * B)
    m = kd.shard_weights(cnn_model(norm=kd.SyncBatchNormalization),
                         min_unit_bytes=1 << 20)
    got = fit(m, kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.5), shard="weights"),
        my_part(x), my_part(y), B)
    assert_close(got, truth, "weights: units, CNN with batch norm", 1e-4)
    same_on_all_ranks(got, "weights: units, CNN")


@check("weights_fit_built_sharded_bfloat16")
def weights_fit_built_sharded_bfloat16():
    # Built inside shard_weights(): each layer sharded once built; under
    # mixed_bfloat16 the shards are gathered (and the gradients
    # reduce-scattered) in bfloat16: against one process 1e-2.
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x, y = data()
        truth = truth_fit(dense_model(), keras.optimizers.Adam(0.01), x, y,
                          N * B)
        start = dense_model().get_weights()
        with kd.shard_weights(remat=True):
            m = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(3, activation="tanh"),
                                  keras.layers.Dense(1)])
            assert all(len(v.shape) == 1 for v in m.trainable_variables)
        kd.shard_weights(m)
        m.set_weights(start)
        got = fit(m, kd.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                             shard="weights"),
                  my_part(x), my_part(y), B)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_close(got, truth, "weights: mixed_bfloat16", 1e-2)
    same_on_all_ranks(got, "weights: mixed_bfloat16")


def frozen_first(seed=1):
    model = dense_model(seed)
    model.layers[0].trainable = False
    return model


@check("weights_fit_frozen_layer")
def weights_fit_frozen_layer():
    # A frozen layer's weights are sharded too (gathered for the forward,
    # never updated), the trainable ones train as one process's.
    m, got = check_weights("weights_fit_frozen_layer",
                           lambda: keras.optimizers.Adam(0.01),
                           model=frozen_first)
    assert all(len(v.shape) == 1 for v in m.weights), \
        [v.path for v in m.weights if len(v.shape) != 1]
    np.testing.assert_array_equal(got[0], frozen_first().get_weights()[0])


def three_layers(seed=1):
    # The middle kernel is 1 MiB (views.ALONE_BYTES): gathered alone.
    return seeded(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(512, activation="tanh"),
        keras.layers.Dense(512, activation="tanh"), keras.layers.Dense(1)]),
        seed, scale=0.05)


def timeline_rows(path, last):
    """{row name: {phase: count}} of rank 0's timeline, once the row
    `last` (the collective run last before the timeline stopped) has an
    event: the writer flushes the events in the order they ran, on its
    own thread, up to 200 ms after."""
    import json
    import time

    deadline = time.monotonic() + 30
    while True:
        try:
            with open(path) as f:
                events = json.load(f)
        except (OSError, ValueError):
            events = []
        names = {e["tid"]: e["args"].get("tensor", e["args"]["name"])
                 for e in events if e.get("name") == "thread_name"}
        rows = {}
        for e in events:
            if e.get("ph") == "X" and e["tid"] in names:
                phases = rows.setdefault(names[e["tid"]], {})
                phases[e["name"]] = phases.get(e["name"], 0) + 1
        if last in rows:
            return rows
        assert time.monotonic() < deadline, f"{path}: no {last}: {rows}"
        time.sleep(0.05)


@check("weights_one_gather_per_layer")
def weights_one_gather_per_layer():
    # Three Dense layers, a kernel and a bias each (6 variables): a step
    # gathers each layer's weights in one allgather and reduce-scatters
    # their gradients in one, but the 1 MiB kernel's alone (4 + 4
    # collectives; one a variable made 6 + 6), and trains as one process
    # does.
    m, _ = check_weights("weights_one_gather_per_layer",
                         lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                         model=three_layers, remat=False)
    x, y = data()
    path = os.path.join(DIR, "weights_one_gather_per_layer.json")
    kd.timeline.start_timeline(path)
    m.fit(my_part(x)[:B], my_part(y)[:B], batch_size=B, epochs=1,
          shuffle=False, verbose=0)
    gather(np.zeros(1, "float32"))  # after every rank's step
    last = f"test.gather.{_seq[0]}"
    kd.timeline.stop_timeline()
    if R != 0:
        return
    rows = timeline_rows(path, last)
    # TensorFlow's names begin with the graph's name scope.
    gathers = sorted(n for n, p in rows.items()
                     if "kerasdist.w." in n and "ALLGATHER" in p)
    scatters = sorted(n for n, p in rows.items()
                      if "kerasdist.w." in n and "REDUCESCATTER" in p)
    print(f"weights_one_gather_per_layer: a step's gathers {gathers}, "
          f"reduce-scatters {scatters}", flush=True)
    assert len(gathers) == 4, rows
    assert len(scatters) == 4, rows
    alone = [n for n in gathers if "/kernel" in n and "/kernel+" not in n]
    assert len(alone) == 1, gathers
    assert all(rows[n]["ALLGATHER"] == 1 for n in gathers), rows


@check("weights_custom_loop", groups=("tensorflow",))
def weights_custom_loop():
    # A tf.GradientTape loop: the tape's gradients of the shards are
    # averaged already, and apply() updates the shards.
    import tensorflow as tf

    x, y = data()
    truth = truth_fit(dense_model(), keras.optimizers.SGD(0.1), x, y, N * B)
    # Every layer rematerialized: its gathers wait for its input.
    m = kd.shard_weights(dense_model(), remat=True)
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="weights")
    xs, ys = my_part(x), my_part(y)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(m(xb) - yb))
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply(grads, m.trainable_variables)

    for i in range(STEPS):
        step(xs[i * B:(i + 1) * B], ys[i * B:(i + 1) * B])
    assert_close(m.get_weights(), truth, "weights: custom loop")
    # Each layer's gather (the forward's, the backward's again: one for
    # its kernel and bias together) is ordered after its layer's input,
    # else the graph runs them all at the step's start.
    graph = step.get_concrete_function(xs[:B], ys[:B]).graph
    gathers = [op for op in graph.get_operations()
               if op.type == "KerasdistAllgather"]
    assert len(gathers) == 2 * len(m.layers), len(gathers)
    def ordered(op, hops=4):  # reshape(identity(shard)) and the like
        return bool(op.control_inputs) or hops > 0 and any(
            ordered(t.op, hops - 1) for t in op.inputs)

    for op in gathers:
        assert ordered(op.inputs[0].op), op.name


@check("weights_custom_loop_jax_torch", groups=("jax", "torch"))
def weights_custom_loop_jax_torch():
    # Keras' own custom-loop recipes for each backend: PyTorch's eager
    # backward and `apply`; JAX's jitted `stateless_call` and
    # `stateless_apply`. The shards' gradients are averaged already.
    x, y = data()
    truth = truth_fit(dense_model(), keras.optimizers.SGD(0.1), x, y, N * B)
    m = kd.shard_weights(dense_model())
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="weights")
    opt.build(m.trainable_variables)
    xs, ys = my_part(x), my_part(y)
    batches = [(xs[i * B:(i + 1) * B], ys[i * B:(i + 1) * B])
               for i in range(STEPS)]
    if BACKEND == "torch":
        import torch

        for xb, yb in batches:
            loss = torch.mean(torch.square(m(xb) - torch.as_tensor(yb)))
            m.zero_grad()
            loss.backward()
            grads = [v.value.grad for v in m.trainable_variables]
            with torch.no_grad():
                opt.apply(grads, m.trainable_variables)
    else:
        import jax

        def loss_fn(tv, ntv, xb, yb):
            out, ntv = m.stateless_call(tv, ntv, xb)
            return jax.numpy.mean(jax.numpy.square(out - yb)), ntv

        @jax.jit
        def step(state, xb, yb):
            tv, ntv, ov = state
            (_, ntv), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                tv, ntv, xb, yb)
            tv, ov = opt.stateless_apply(ov, grads, tv)
            return tv, ntv, ov

        state = ([v.value for v in m.trainable_variables],
                 [v.value for v in m.non_trainable_variables],
                 [v.value for v in opt.variables])
        for xb, yb in batches:
            state = step(state, xb, yb)
        for v, value in zip(m.trainable_variables, state[0]):
            v.assign(value)
    assert_close(m.get_weights(), truth, "weights: custom loop")
    same_on_all_ranks(m.get_weights(), "weights: custom loop")


@check("weights_fit_jit_compile", groups=("tensorflow", "torch"))
def weights_fit_jit_compile():
    # Keras' jit_compile=True: on TensorFlow XLA compiles the step with
    # the gathers and reduce-scatters in it (their XLA kernels); on
    # PyTorch (torch.compile of the step) they are ops whose shapes the
    # layout gives, traced into the compiled step.
    x, y = data()
    truth = truth_fit(dense_model(), keras.optimizers.SGD(
        0.1, momentum=0.5), x, y, N * B)
    m = kd.shard_weights(dense_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fit(m, kd.DistributedOptimizer(keras.optimizers.SGD(
            0.1, momentum=0.5), shard="weights"), my_part(x), my_part(y), B,
            jit_compile=True)
    said = [str(w.message) for w in caught if "kerasdist" in str(w.message)]
    assert not said and m.jit_compile is True, (said, m.jit_compile)
    assert_close(got, truth, "weights: jit_compile")
    if BACKEND != "torch":
        return
    import torch

    # A layout the ranks do not share (a step compiled at another size):
    # an error on every rank, never a result of another shape.
    try:
        torch.ops.kerasdist.shard_gather(torch.ones(1, 3),
                                         "weights.jit.layout", N + 1)
    except RuntimeError as e:
        assert f"gave {N} row(s) where its layout expects {N + 1}" in \
            str(e), str(e)
    else:
        raise AssertionError("a gather against another layout: no error")


@check("weights_jax_gathers_tied", groups=("jax",))
def weights_jax_gathers_tied():
    # XLA schedules by data only: unless each gather depends on its
    # layer's input (in the backward, on the cotangent), every layer's
    # whole weights are gathered at the step's start. The jitted step's
    # temporaries hold under four kernels (one layer's gathered kernel
    # and bias, the kernel's copy out of them, its gradient and the
    # gradients' buffer for the one reduce-scatter), not eight (2 MiB
    # before the ties; seven when the backward's second gathers waited
    # for the saved input, which XLA recomputed from the layer before's
    # gathered weights, keeping those alive).
    import jax

    width, depth = 256, 6
    m = keras.Sequential([keras.Input((width,))] + [
        keras.layers.Dense(width, activation="relu") for _ in range(depth)
    ] + [keras.layers.Dense(1)])
    kd.shard_weights(m, remat=True)
    opt = kd.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                  shard="weights")
    m.compile(optimizer=opt, loss="mse")
    x = np.ones((2, width), "float32")
    y = np.zeros((2, 1), "float32")
    m.fit(x, y, batch_size=2, epochs=1, verbose=0)
    state = ([v.value for v in m.trainable_variables],
             [v.value for v in m.non_trainable_variables],
             [v.value for v in m.optimizer.variables],
             [v.value for v in m.metrics_variables])
    temp = jax.jit(m.train_step).lower(state, (x, y)).compile() \
        .memory_analysis().temp_size_in_bytes
    kernel = width * width * 4
    assert temp < 4 * kernel, (temp, kernel)


def remat_model(seed=1):
    """dense_model with every layer built under keras.RematScope("full"):
    Keras recomputes each layer's call in the backward."""
    with keras.RematScope(mode="full"):
        return dense_model(seed)


@check("remat_scope_every_mode")
def remat_scope_every_mode():
    # keras.RematScope with the replicated optimizer and each shard=
    # mode: one process without remat is the truth (the recomputation
    # changes no value). With sharded weights a layer is recomputed with
    # its gathers (on JAX Keras' jax.checkpoint refuses them; the
    # model's own remat, around its layers, is left out). On TensorFlow
    # Keras' remat fails in a traced step whatever the optimizer
    # (keras#21207): sharded weights only, whose layers kerasdist
    # recomputes itself.
    x, y = data()
    adam = functools.partial(keras.optimizers.Adam, 0.01)
    truth = truth_fit(dense_model(), adam(), x, y, N * B)
    assert np.max(np.abs(flat(truth) - flat(dense_model().get_weights()))) \
        > 100 * ATOL, "remat: the truth did not train"
    modes = ("weights",) if BACKEND == "tensorflow" else (
        None, "optimizer_state", "gradients", "weights")
    for shard in modes:
        m = remat_model()
        if shard == "weights":
            kd.shard_weights(m, remat=False)
        got = fit(m, kd.DistributedOptimizer(adam(), shard=shard),
                  my_part(x), my_part(y), B)
        assert_close(got, truth, f"remat_scope_every_mode[{shard}]")
        same_on_all_ranks(got, f"remat_scope_every_mode[{shard}]")


@check("shard_weights_refusals")
def shard_weights_refusals():
    def refused(make, words):
        try:
            make()
        except ValueError as e:
            assert words in str(e), e
            return
        raise AssertionError(f"not refused: {words}")

    x, y = data()
    refused(lambda: fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), shard="weights"), x[:B], y[:B], B),
        "kerasdist.shard_weights(model)")
    refused(lambda: fit(kd.shard_weights(dense_model()),
                        kd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                        x[:B], y[:B], B),
            "shard='weights'")
    refused(lambda: kd.shard_weights(keras.Sequential(
        [keras.layers.Dense(2)])), "not built")
    constrained = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
        2, kernel_constraint=keras.constraints.NonNeg())])
    refused(lambda: kd.shard_weights(constrained), "constraint")
    refused(lambda: kd.shard_weights(min_unit_bytes=1 << 20),
            "applies to a built model")
    if BACKEND == "jax":
        # A loss added inside a call JAX recomputes (a custom VJP).
        class LossInCall(keras.layers.Dense):
            def call(self, inputs):
                self.add_loss(0.0 * keras.ops.sum(self.kernel))
                return super().call(inputs)

        lossy = kd.shard_weights(keras.Sequential(
            [keras.Input((4,)), LossInCall(1)]), remat=True)
        refused(lambda: fit(lossy, kd.DistributedOptimizer(
            keras.optimizers.SGD(0.1), shard="weights"), x[:B], y[:B], B),
            "adds a loss inside its call (add_loss)")


def refused_saying(make, words, error=ValueError):
    """`make()` raises `error` whose message holds every one of `words`."""
    try:
        make()
    except error as e:
        assert all(w in str(e) for w in words), (words, e)
    else:
        raise AssertionError(f"accepted: {words}")


@check("shard_refusals", groups=("tensorflow",))
def shard_refusals():
    refused = refused_saying
    sgd = keras.optimizers.SGD
    refused(lambda: kd.DistributedOptimizer(sgd(0.1), shard="all"),
            ["shard must be None", "'weights'", "'all'"])
    refused(lambda: kd.DistributedOptimizer(sgd(0.1), shard="weights",
                                            backward_passes_per_step=2),
            ["shard='weights'", "gradient_accumulation_steps"])
    refused(lambda: kd.DistributedOptimizer(keras.optimizers.Lamb(0.1),
                                            shard="optimizer_state"),
            ["Lamb", "shard=None"])
    for mode in ("gradients", "weights"):
        refused(lambda: kd.DistributedOptimizer(sgd(0.1), op=kd.Adasum,
                                                shard=mode),
                ["Adasum", f"shard={mode!r}"])
    pair = kd.add_process_set([0])
    try:
        refused(lambda: kd.DistributedOptimizer(sgd(0.1), shard="weights",
                                                process_set=pair),
                ["shard='weights'", "nor a process_set"])
    finally:
        kd.remove_process_set(pair)
    refused(lambda: kd.DistributedOptimizer(
        keras.optimizers.LossScaleOptimizer(sgd(0.1)), shard="gradients"),
        ["LossScaleOptimizer(DistributedOptimizer(opt, shard=...))"])
    opt = kd.DistributedOptimizer(sgd(0.1), shard="optimizer_state")
    model = dense_model()
    opt.register_local_var(model.layers[-1].bias)
    model.compile(optimizer=opt, loss="mse")
    x, y = data()
    refused(lambda: model.fit(my_part(x), my_part(y), batch_size=B,
                              verbose=0), ["local variables"])


@check("shard_gradients_released", groups=("torch",))
def shard_gradients_released():
    """PyTorch keeps `.grad` between steps: shard="gradients" drops each
    whole gradient once reduce-scattered, "optimizer_state" keeps it."""
    x, y = data()
    for shard, kept in (("gradients", False), ("optimizer_state", True)):
        model = dense_model()
        fit(model, kd.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                           shard=shard),
            my_part(x), my_part(y), B)
        grads = [v.value.grad for v in model.trainable_variables]
        assert all((g is not None) == kept for g in grads), (shard, grads)


@check("shard_gathers_ahead", groups=("torch",))
def shard_gathers_ahead():
    """PyTorch starts the sharded optimizer's allgathers ahead, up to a
    bound of bytes in flight (`Torch.gather_each`): with a bound that
    lets only one run at a time the fit is still one process's; results
    come in order; a caller that stops early leaves nothing behind (the
    collectives after it meet). The gathers write into tensors of the
    layout's shape, and only where the result has it."""
    import torch

    from kerasdist.keras import framework as _framework
    from kerasdist.torch import _keras_layer

    bound = _keras_layer.GATHER_AHEAD_BYTES
    _keras_layer.GATHER_AHEAD_BYTES = 1
    try:
        check_shard("shard_gathers_one_at_a_time",
                    lambda: keras.optimizers.Adam(0.001), shard="gradients",
                    model=wide_model)
    finally:
        _keras_layer.GATHER_AHEAD_BYTES = bound
    framework = _framework.get()
    rows = [torch.full((k + 1,), float(10 * k + kd.rank()))
            for k in range(4)]
    names = [f"gathers_ahead.{k}" for k in range(4)]
    every = list(framework.gather_each(rows, names, N))
    for k, got in enumerate(every):
        want = np.concatenate([np.full(k + 1, 10.0 * k + r)
                               for r in range(N)])
        np.testing.assert_array_equal(got.numpy(), want)
    early = framework.gather_each(rows, [n + ".early" for n in names], N)
    np.testing.assert_array_equal(next(early).numpy(),
                                  np.arange(N, dtype=np.float32))
    early.close()
    total = kd.allreduce(np.ones(3, np.float32), op=kd.Sum,
                         name="gathers_ahead.after")
    np.testing.assert_array_equal(np.asarray(total), np.full(3, float(N)))
    # The core writes a result straight into the caller's buffer only
    # where it has the shape the caller gave (kerasdist_enqueue_into):
    # told to expect one element less, it writes nothing there.
    from kerasdist._core import capi
    from kerasdist.torch import collectives as _tc

    x = torch.full((3,), float(kd.rank()))
    for expect, written in ((3 * N, True), (3 * N - 1, False)):
        buffer = torch.full((3 * N + 2,), -7.0)
        h = _tc._start(capi.OP_ALLGATHER, f"into.{expect}", x, buffer,
                       into_shape=(expect,))
        h.wait()
        _, shape = h.output()
        assert tuple(shape) == (3 * N,), shape
        want = np.full(3 * N + 2, -7.0, np.float32)
        if written:
            want[:3 * N] = np.repeat(np.arange(N, dtype=np.float32), 3)
        np.testing.assert_array_equal(buffer.numpy(), want)
    # An op whose result has its input's shape writes into the buffer
    # whatever shape it was told (as kerasdist_enqueue).
    out = torch.zeros(3)
    h = _tc._start(capi.OP_ALLREDUCE, "into.allreduce", x, out,
                   into_shape=(99,), reduce_op=int(kd.Sum))
    h.wait()
    np.testing.assert_array_equal(out.numpy(),
                                  np.full(3, float(sum(range(N)))))
    print("shard_gathers_ahead: ok", flush=True)


@check("shard_stateless_apply_torch", groups=("torch",))
def shard_stateless_apply_torch():
    """PyTorch: a sharded optimizer's `stateless_apply` returns the new
    values and leaves the model's variables as they were (its own copies
    go through Keras' StatelessScope); training by it is one process's."""
    import torch

    make = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    x, y = data()
    truth = truth_fit(dense_model(), make(), x, y, N * B)
    m = dense_model()
    opt = kd.DistributedOptimizer(make(), shard="gradients")
    opt.build(m.trainable_variables)
    xs, ys = my_part(x), my_part(y)
    ov = [v.value.detach().clone() for v in opt.variables]
    for i in range(STEPS):
        xb, yb = xs[i * B:(i + 1) * B], ys[i * B:(i + 1) * B]
        params = [v.value for v in m.trainable_variables]
        loss = torch.mean(torch.square(m(xb) - torch.as_tensor(yb)))
        grads = torch.autograd.grad(loss, params)
        before = [p.detach().clone() for p in params]
        # Copies: Keras' own update on PyTorch writes into the values it
        # is given (its foreach ops), as the plain optimizer does.
        tv, ov = opt.stateless_apply(ov, list(grads),
                                     [p.detach().clone() for p in params])
        for b, v in zip(before, m.trainable_variables):
            assert torch.equal(b, v.value.detach()), \
                f"stateless_apply changed {v.path}"
        for v, value in zip(m.trainable_variables, tv):
            v.assign(value)
    assert_close(m.get_weights(), truth, "shard: stateless_apply")
    same_on_all_ranks(m.get_weights(), "shard: stateless_apply")


@check("shard_reduce_scatter_in_backprop", groups=("torch",))
def shard_reduce_scatter_in_backprop():
    """PyTorch: from the second step on, the sharded optimizer's
    reduce-scatters start from autograd hooks, each bucket as backprop
    makes its last gradient; with shard="gradients" the hooks drop the
    whole `.grad` as they go (None after backward) and apply takes the
    shards: one process's weights, in fit and in a custom loop. A second
    backward pass, or other gradients than `.grad`, after the release
    fail with one error each; "optimizer_state" keeps `.grad`, and a
    gradient changed in place goes through the synchronous path."""
    import torch

    refused = refused_saying
    x, y = data()
    for shard in ("gradients", "optimizer_state"):
        opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                      shard=shard, **TINY_BUCKETS)
        check_shard(f"backprop {shard}", lambda: keras.optimizers.SGD(
            0.1, momentum=0.5), shard=shard, **TINY_BUCKETS)
        model = dense_model()
        variables = model.trainable_variables
        truth = truth_fit(dense_model(), keras.optimizers.SGD(
            0.1, momentum=0.5), x, y, N * B)
        xs, ys = my_part(x), my_part(y)
        for s in range(STEPS):
            for v in variables:
                v.value.grad = None
            xb = torch.as_tensor(xs[s * B:(s + 1) * B])
            yb = torch.as_tensor(ys[s * B:(s + 1) * B])
            torch.mean((model(xb) - yb) ** 2).backward()
            grads = [v.value.grad for v in variables]
            if s and shard == "gradients":
                assert all(g is None for g in grads), s
            if s == STEPS - 1 and shard == "optimizer_state":
                grads[0].mul_(1.0)  # a new version: reduced again
            opt.apply(grads, variables)
        got = [keras.ops.convert_to_numpy(v) for v in variables]
        assert_close(got, truth, f"backprop {shard}: custom loop")
        ev = opt._kerasdist_overlap.shards.last_events
        want = ("collect", (0,)) if shard == "optimizer_state" else (
            "collect", ())
        assert ev[-1] == want, ev
        starts = [e for e in ev if e[0] == "start"]
        assert len(starts) == 3, ev
        last_grad = max(i for i, e in enumerate(ev) if e[0] == "grad")
        assert ev.index(starts[0]) < last_grad, ev
    # Keras' jit_compile=True (torch.compile): the optimizer's apply runs
    # outside the compiled step, the hooks as in eager.
    got = fit(dense_model(), kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.5), shard="gradients",
        **TINY_BUCKETS), my_part(x), my_part(y), B, jit_compile=True)
    assert_close(got, truth_fit(dense_model(), keras.optimizers.SGD(
        0.1, momentum=0.5), x, y, N * B), "backprop gradients: jit_compile")
    # A LossScaleOptimizer unscales its own copies: no release, the
    # loss scale's truth.
    check_shard("backprop gradients: loss scale",
                      lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                      shard="gradients", wrap=lambda o: keras.optimizers.
                      LossScaleOptimizer(o, initial_scale=2.0**10),
                      **TINY_BUCKETS)
    # After the release: a second backward pass, other gradients.
    xb, yb = torch.as_tensor(x[:B]), torch.as_tensor(y[:B])
    model = dense_model()
    opt = kd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                  shard="gradients")
    variables = model.trainable_variables
    for _ in range(2):  # the first step installs the hooks
        torch.mean((model(xb) - yb) ** 2).backward()
        opt.apply([v.value.grad for v in variables], variables)
    torch.mean((model(xb) - yb) ** 2).backward()
    refused(lambda: torch.mean((model(xb) - yb) ** 2).backward(),
            ["second backward pass", "backward_passes_per_step"],
            RuntimeError)
    for v in variables:
        v.value.grad = None
    torch.mean((model(xb) - yb) ** 2).backward()
    refused(lambda: opt.apply([torch.ones_like(v.value) for v in variables],
                              variables), ["other gradients", "None"])


@check("shard_save_model_model_checkpoint_any_size")
def shard_save_model_model_checkpoint_any_size():
    """A sharded fit's files (kd.callbacks.ModelCheckpoint, kd.save_model)
    hold the whole optimizer state in the plain layout: plain Keras loads
    it, equal to the replicated optimizer's after the same training; a
    sharded optimizer resumes from them (sharded at this size, whole at a
    size of one, and from the .keras file by kd.load_model) and goes on as
    the uninterrupted replicated run."""
    x, y = data()
    xs, ys = my_part(x), my_part(y)
    ckpt = os.path.join(DIR, "shard_ckpt")
    keras_file = os.path.join(DIR, "shard_model.keras")

    def adam():
        return keras.optimizers.Adam(0.01)

    def one_epoch(model, callbacks=()):
        model.fit(xs, ys, batch_size=B, epochs=1, shuffle=False, verbose=0,
                  callbacks=list(callbacks))
        return model

    def slots(opt):
        return [keras.ops.convert_to_numpy(v) for v in opt.variables]

    model = dense_model()
    model.compile(kd.DistributedOptimizer(adam(), shard="optimizer_state"),
                  "mse")
    one_epoch(model, [kd.callbacks.ModelCheckpoint(
        os.path.join(ckpt, "e{epoch}.weights.h5"))])
    kd.save_model(model, keras_file)
    ref = dense_model()
    ref.compile(kd.DistributedOptimizer(adam()), "mse")
    one_epoch(ref)
    gather(np.zeros(1, "float32"))  # rank 0's files are written
    plain = keras.models.load_model(keras_file)
    assert isinstance(plain.optimizer, keras.optimizers.Adam)
    assert not hasattr(plain.optimizer, "_kerasdist_settings")
    assert_close(plain.get_weights(), ref.get_weights(), "saved weights")
    assert_close(slots(plain.optimizer), slots(ref.optimizer),
                 "saved optimizer state, whole")
    one_epoch(ref)  # the uninterrupted run's second epoch
    latest = kd.callbacks.latest_checkpoint(ckpt)
    resumed = dense_model(seed=7)
    resumed.compile(kd.DistributedOptimizer(adam(), shard="gradients"),
                    "mse")
    assert kd.callbacks.load_checkpoint(latest, resumed) == 1
    assert_close(one_epoch(resumed).get_weights(), ref.get_weights(),
                 "resumed from ModelCheckpoint, sharded")
    loaded = kd.load_model(keras_file, shard="optimizer_state")
    assert_close(one_epoch(loaded).get_weights(), ref.get_weights(),
                 "resumed from kd.save_model's file by kd.load_model")
    same_on_all_ranks(loaded.get_weights(), "resumed")
    # model.summary() says what its "Optimizer params" counted.
    lines = []
    model.summary(print_fn=lines.append)
    whole = sum(int(np.prod(v.shape)) for v in ref.optimizer.variables)
    notes = [l for l in lines if "Optimizer params above" in l]
    assert len(notes) == 1 and f"rank {R}'s shard" in notes[0] and \
        f"holds {whole:,} params" in notes[0], lines[-3:]
    if R == 0:
        # model.save() alone loses the whole optimizer, and says so.
        lost = os.path.join(DIR, "shard_model_save.keras")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.save(lost)
        said = [str(w.message) for w in caught
                if "loses the whole optimizer" in str(w.message)]
        assert len(said) == 1 and "kerasdist.save_model(model, path) on " \
            "every rank" in said[0], [str(w.message) for w in caught]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            back = keras.models.load_model(lost)
        assert int(keras.ops.convert_to_numpy(
            back.optimizer.iterations)) == 0  # as the warning says
    alone = kd.add_process_set([0])
    try:
        if R == 0:  # a sharded optimizer of one rank: its shards are whole
            one = dense_model(seed=7)
            opt = kd.DistributedOptimizer(adam(), shard="optimizer_state",
                                          process_set=alone)
            one.compile(opt, "mse")
            kd.callbacks.load_checkpoint(latest, one)
            assert_close(slots(opt), slots(plain.optimizer),
                         "loaded at a size of one")
    finally:
        kd.remove_process_set(alone)


if __name__ == "__main__":
    checks.main(rank=R)
