"""Collectives under a timeline, for tests/parallel/test_timeline.py.

    timeline_worker.py env             # KERASDIST_TIMELINE set by the test
    timeline_worker.py runtime DIR     # start/stop at run time
    timeline_worker.py fit DIR         # model.fit, DistributedOptimizer

`env`: a few steps of a tf.function with allreduces named tl.grad.0..3 (two
fusable float32 and two of other dtypes), an allgather and a broadcast.
`runtime`: steps before, inside and after `kerasdist.timeline.timeline(...)`
(DIR/a.json) with distinct tensor names, then a second timeline with cycle
markers (DIR/b.json) started and stopped by the functions. `fit`: three
steps of model.fit with DistributedOptimizer on the Keras backend that
KERAS_BACKEND names, under DIR/fit.json. Prints "OK".
"""

import os
import sys

import numpy as np

import kerasdist as kd

tf = None  # TensorFlow, imported by main() where it is used


def _steps(prefix, count):
    rank, n = kd.rank(), kd.size()
    xs = [tf.fill([256], float(rank + 1)), tf.fill([1024], float(rank)),
          tf.fill([64], float(rank + 2)), tf.cast(tf.fill([8], rank), tf.int32)]

    @tf.function(autograph=False)
    def step():
        return [kd.allreduce(x, op=kd.Sum, name=f"{prefix}.{i}")
                for i, x in enumerate(xs)]

    for _ in range(count):
        outs = step()
        want = [n * (n + 1) / 2, n * (n - 1) / 2, n * (n + 3) / 2,
                n * (n - 1) / 2]
        for got, w in zip(outs, want):
            assert np.all(got.numpy() == w), (prefix, got.numpy()[:3], w)


def _fit(out):
    import keras
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(7, name="first"),
                              keras.layers.Dense(2, name="second")])
    model.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.SGD(0.1)), loss="mse")
    rng = np.random.default_rng(kd.rank())
    x = rng.normal(size=(24, 5)).astype("float32")
    y = rng.normal(size=(24, 2)).astype("float32")
    with kd.timeline.timeline(os.path.join(out, "fit.json")):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def main():
    global tf
    mode = sys.argv[1]
    # `fit` on JAX or PyTorch uses no TensorFlow.
    if mode != "fit" or os.environ.get("KERAS_BACKEND",
                                        "tensorflow") == "tensorflow":
        import tensorflow as tf
    kd.init()
    rank = kd.rank()
    if mode == "fit":
        _fit(sys.argv[2])
    elif mode == "env":
        _steps("tl.grad", 5)
        g = kd.allgather(tf.fill([2], float(rank)), name="tl.gather")
        assert g.shape[0] == 2 * kd.size()
        b = kd.broadcast(tf.fill([3], float(rank)), root_rank=0,
                         name="tl.bcast")
        assert np.all(b.numpy() == 0.0)
    else:
        out = sys.argv[2]
        _steps("before", 2)
        with kd.timeline.timeline(os.path.join(out, "a.json")) as path:
            assert path.endswith("a.json")
            _steps("inside", 3)
        _steps("after", 2)
        kd.timeline.start_timeline(os.path.join(out, "b.json"),
                                   mark_cycles=True)
        _steps("second", 3)
        kd.timeline.stop_timeline()
        kd.timeline.stop_timeline()  # stopping twice is fine
    kd.shutdown()
    try:
        kd.timeline.start_timeline("x.json")
    except RuntimeError as e:
        assert "not initialized" in str(e), e
    else:
        raise AssertionError("start_timeline after shutdown did not raise")
    print("OK", flush=True)


if __name__ == "__main__":
    main()
