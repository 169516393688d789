"""Worker for tests/parallel/test_keras_hub.py: a keras-hub task under
`kerasdist run`, as docs/keras.md's keras-hub section shows it, on the
Keras backend that KERAS_BACKEND names (tensorflow, jax or torch):

    KERAS_BACKEND=jax python -m kerasdist.run -np 2 python \
        tests/workers/keras_hub_worker.py [--group weights]

A GemmaCausalLM built from a config (random weights, nothing downloaded,
no tokenizer: token ids in, logits out). keras-hub tasks compile
themselves in their constructor with their own optimizer, so a `fit`
without a `compile` trains each rank on its own gradients: kerasdist must
say so before the first step. Compiled with `kd.DistributedOptimizer` it
must train as one process on the concatenated batch, fully and with LoRA,
replicated and sharded; with its weights sharded (`kd.shard_weights`,
`shard="weights"`, the frozen LoRA base sharded too), the same, and then
`generate()` gives the tokens one process gives. The test runs group
"weights" on every backend and every check on TensorFlow. SGD: Adam
would turn round-off in a parameter whose true gradient is zero into
full steps. Truths are numpy arrays read from the Keras variables
(keras.ops.convert_to_numpy), on every backend.
"""

import warnings

import keras
import keras_hub
import numpy as np

import kerasdist as kd
from tests.support import checks
from tests.support.checks import check

BACKEND = keras.backend.backend()
if BACKEND == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.get_logger().setLevel("ERROR")
elif BACKEND == "torch":
    import torch

    torch.set_num_threads(1)
kd.init()
RANK, SIZE = kd.rank(), kd.size()
B, STEPS, SEQ, VOCAB = 2, 3, 6, 32


def task(lora=False):
    """The same tiny Gemma on every call and every rank."""
    keras.utils.set_random_seed(7)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16,
        head_dim=4, dtype="float32")
    if lora:
        backbone.enable_lora(rank=2)
        # LoRA's B starts at zero: give it values, so that both of its
        # matrices move from the first step.
        for w in backbone.trainable_weights:
            if "lora_kernel_b" in w.path:
                w.assign(keras.random.normal(w.shape, stddev=0.1, seed=3))
    return keras_hub.models.GemmaCausalLM(backbone=backbone,
                                          preprocessor=None)


def data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(STEPS * SIZE * B, SEQ + 1))
    x = {"token_ids": tokens[:, :-1],
         "padding_mask": np.ones((len(tokens), SEQ), bool)}
    return x, tokens[:, 1:]


def mine(a):
    """Rank r's rows of every global batch of SIZE*B."""
    g = a.reshape(STEPS, SIZE, B, *a.shape[1:])
    return g[:, RANK].reshape(STEPS * B, *a.shape[1:])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def check_equivalent(label, lora, **kd_args):
    x, y = data()
    truth = task(lora)
    truth.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss())
    truth.fit(x, y, batch_size=SIZE * B, shuffle=False, verbose=0)
    model = task(lora)
    start = [keras.ops.convert_to_numpy(w) for w in model.trainable_weights]
    model.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.SGD(0.5), **kd_args), loss=loss())
    model.fit({k: mine(v) for k, v in x.items()}, mine(y), batch_size=B,
              shuffle=False, verbose=0,
              callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0)])
    got = [keras.ops.convert_to_numpy(w) for w in model.trainable_weights]
    want = [keras.ops.convert_to_numpy(w) for w in truth.trainable_weights]
    assert len(got) == len(want) and got, (len(got), len(want))
    for g, w, s, v in zip(got, want, start, model.trainable_weights):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6,
                                   err_msg=f"{label}: {v.path}")
        assert not np.array_equal(g, s), f"{label}: {v.path} did not train"
    every = kd.allgather_object([float(np.sum(g)) for g in got])
    assert all(e == every[0] for e in every), every
    if lora:  # the base stays frozen
        assert all("lora" in w.path for w in model.trainable_weights)


@check("keras_hub_task_fit_averaged")
def task_fit_averaged():
    check_equivalent("full", lora=False)


@check("keras_hub_lora_sharded_averaged")
def lora_sharded_averaged():
    check_equivalent("lora sharded", lora=True, shard="gradients")


def check_weights_sharded(label, lora):
    """kd.shard_weights + shard="weights": the same truth, the whole
    weights read back through get_weights."""
    x, y = data()
    truth = task(lora)
    truth.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss())
    truth.fit(x, y, batch_size=SIZE * B, shuffle=False, verbose=0)
    model = task(lora)
    start = model.get_weights()
    kd.shard_weights(model)
    # Every weight is a shard, the frozen LoRA base too.
    assert not [v.path for v in model.weights if len(v.shape) > 1], [
        v.path for v in model.weights if len(v.shape) > 1]
    model.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.SGD(0.5), shard="weights"), loss=loss())
    model.fit({k: mine(v) for k, v in x.items()}, mine(y), batch_size=B,
              shuffle=False, verbose=0,
              callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0)])
    got, want = model.get_weights(), truth.get_weights()
    assert len(got) == len(want) and got, (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6,
                                   err_msg=f"{label}: weight {i}")
    moved = sum(not np.array_equal(g, s) for g, s in zip(got, start))
    trained = len(truth.trainable_weights)
    assert moved == trained, (label, moved, trained)
    # generate() reads the whole weights as one process does.
    prompt = {"token_ids": np.array([[1, 2, 3, 0, 0, 0]]),
              "padding_mask": np.array([[1, 1, 1, 0, 0, 0]], bool)}
    np.testing.assert_array_equal(
        model.generate(prompt, max_length=SEQ,
                       stop_token_ids=None)["token_ids"],
        truth.generate(prompt, max_length=SEQ,
                       stop_token_ids=None)["token_ids"])


@check("keras_hub_weights_sharded", groups=("default", "weights"))
def weights_sharded():
    check_weights_sharded("weights sharded", lora=False)
    check_weights_sharded("lora, weights sharded", lora=True)


@check("keras_hub_own_optimizer_says_so")
def own_optimizer_says_so():
    # The task's own compile (its own Adam), fit with kerasdist's
    # callback: one warning, before the first step, naming the fix.
    model = task()
    x, y = data()
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit({k: mine(v) for k, v in x.items()}, mine(y), batch_size=B,
                  epochs=2, shuffle=False, verbose=0, callbacks=[
                      kd.callbacks.BroadcastGlobalVariablesCallback(0),
                      keras.callbacks.LambdaCallback(
                          on_train_batch_begin=lambda b, logs: steps.append(
                              len(caught)))])
    said = [str(w.message) for w in caught
            if "not a kerasdist DistributedOptimizer" in str(w.message)]
    # Rank 0 says it, once for the two epochs; the others say nothing.
    assert len(said) == (1 if RANK == 0 else 0), [
        str(w.message) for w in caught]
    if RANK == 0:
        assert "task.compile(optimizer=kd.DistributedOptimizer(" in \
            said[0], said
        assert "each of the 2 ranks trains on its own gradients" in \
            said[0], said
        assert steps[0] == 1, "not said before the first step"
    # Compiled with the wrapper, nothing is said.
    model = task()
    model.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1)), loss=loss())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit({k: mine(v) for k, v in x.items()}, mine(y), batch_size=B,
                  shuffle=False, verbose=0, callbacks=[
                      kd.callbacks.BroadcastGlobalVariablesCallback(0),
                      kd.callbacks.MetricAverageCallback()])
    assert not [w for w in caught if "DistributedOptimizer" in
                str(w.message)], [str(w.message) for w in caught]


if __name__ == "__main__":
    checks.main(rank=RANK)
