"""What kerasdist costs per step when there is nothing to communicate (np=1).

    python benchmarks/overhead.py [--rounds 7] [--calls 50] [--plot o.png]

A tiny model (Dense(64) -> Dense(10) on 32 features, batch 32: 4 gradient
tensors) trained one batch at a time, each step timed on its own, the
systems alternating round by round in one process:

- keras: plain Keras, `model.train_on_batch`;
- kerasdist DistributedOptimizer: the same with the optimizer wrapped (at
  np=1 it skips the collectives, so this is the wrapper's cost);
- tf.function, no kerasdist: a custom train step (tf.function) without
  collectives, the reference for the next two;
- tf.function + allreduce: the same train step (tf.function) that
  allreduces every gradient through kerasdist even at np=1: the runtime's
  full path (enqueue, negotiation with itself, completion) per tensor;
- the same with the timeline on (written to a temporary file).

Reports the median step time and the difference to plain Keras (the
overhead), and the ratio timeline on / off.
"""

import argparse
import os
import tempfile

import _common
import numpy as np


def build(tf, keras, kd, rng):
    x = rng.random((32, 32), dtype=np.float32)
    y = rng.integers(0, 10, size=(32,))

    def model(opt):
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((32,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
        m.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), jit_compile=False)
        return m

    plain = model(keras.optimizers.SGD(0.01))
    dist = model(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)))
    custom = model(keras.optimizers.SGD(0.01))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = custom.optimizer
    tx, ty = tf.constant(x), tf.constant(y)

    @tf.function(autograph=False)
    def step(a, b):
        with tf.GradientTape() as tape:
            loss = loss_fn(b, custom(a, training=True))
        grads = tape.gradient(loss, custom.trainable_variables)
        grads = [kd.allreduce(g, name=f"overhead.{i}")
                 for i, g in enumerate(grads)]
        opt.apply_gradients(zip(grads, custom.trainable_variables))
        return loss

    bare = model(keras.optimizers.SGD(0.01))
    bare_opt = bare.optimizer

    @tf.function(autograph=False)
    def bare_step(a, b):
        with tf.GradientTape() as tape:
            loss = loss_fn(b, bare(a, training=True))
        grads = tape.gradient(loss, bare.trainable_variables)
        bare_opt.apply_gradients(zip(grads, bare.trainable_variables))
        return loss

    return {
        "keras": lambda: plain.train_on_batch(x, y),
        "tf.function, no kerasdist": lambda: bare_step(tx, ty),
        "kerasdist DistributedOptimizer": lambda: dist.train_on_batch(x, y),
        "tf.function + allreduce": lambda: step(tx, ty),
    }


def main():
    _common.quiet_tf()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--plot", help="write a bar chart here")
    args = p.parse_args()
    tf = _common.tf_single_thread()
    import keras

    import kerasdist as kd
    kd.init()
    if kd.size() != 1:
        raise SystemExit("overhead.py measures np=1; run it without the "
                         "launcher (or with -np 1).")
    systems = build(tf, keras, kd, np.random.default_rng(0))
    trace = os.path.join(tempfile.mkdtemp(), "overhead_trace.json")
    with_tl = "tf.function + allreduce, timeline on"
    base_fn = systems["tf.function + allreduce"]
    for fn in systems.values():  # build and trace everything first
        for _ in range(5):
            fn()
    samples = {name: [] for name in list(systems) + [with_tl]}
    for r in range(args.rounds):
        names = list(samples)
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name == with_tl:
                kd.timeline.start_timeline(trace)
                fn = base_fn
            else:
                fn = systems[name]
            for _ in range(args.calls):
                samples[name].append(_common.timed(fn))
            if name == with_tl:
                kd.timeline.stop_timeline()
    med = {k: _common.median(v) for k, v in samples.items()}
    base = med["keras"]
    print(f"# per-step time at np=1, tiny model (4 gradient tensors), median "
          f"of {args.rounds} x {args.calls} steps per system, alternating")
    print(f"# {'system':<38}{'step(us)':>10}{'vs keras(us)':>14}"
          f"{'ratio':>8}")
    for name, t in med.items():
        print(f"  {name:<38}{t * 1e6:>10.1f}{(t - base) * 1e6:>+14.1f}"
              f"{t / base:>8.2f}")
    ref = med["tf.function, no kerasdist"]
    print(f"# allreduce path at np=1: "
          f"{(med['tf.function + allreduce'] - ref) * 1e6:+.1f} us per step "
          f"over the bare tf.function (4 tensors)")
    print(f"# timeline on / off: "
          f"{med[with_tl] / med['tf.function + allreduce']:.3f}; trace "
          f"{os.path.getsize(trace)} bytes")
    if args.plot:
        _common.maybe_plot(args.plot, "per-step time at np=1", "", "us", {
            "step": (list(range(len(med))), [t * 1e6 for t in med.values()])},
            logx=False, logy=False,
            xticks=list(enumerate(["keras", "tf.function", "DistOpt",
                                   "allreduce", "allreduce+tl"])))


if __name__ == "__main__":
    main()
