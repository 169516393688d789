"""The sharded step's gathers on PyTorch, timed alone: the sharded
optimizer's allgather of the updated shards
(`kerasdist.keras.sharding.step.gather`, the end of every sharded step),
and the forward and backward of a model under `kd.shard_weights` (a
layer's gather at its call, its reduce-scatter in the backward).

    python benchmarks/shard_gather.py [--np 2] [--rounds 3] [--calls 100]

The variables of benchmarks/keras_scaling.py's MLP-20 (21 Dense layers,
2.0M parameters; its 3072-wide input flattened), laid out in the sharded
optimizer's buckets of 1 MiB, each rank holding its shard of each. Two
systems alternate round by round within one job: `ahead`, the default
(the allgathers started together, up to
`kerasdist.torch._keras_layer.GATHER_AHEAD_BYTES` of results in flight,
each variable copied in as its own arrives), and `one` (that bound set to
1 byte: each allgather waits for the one before it). A round is the mean
of --calls gathers after the ranks meet; the table shows rank 0's
milliseconds a gather, the median and range over the rounds, and
`one / ahead`. The weights are checked against the shards they came from
after the last round.

Then the same model under `kd.shard_weights(model)`, a forward and a
backward of a batch of 64 a rank (no optimizer), a round being the mean
of --calls // 4 of them: `torch`, the default (`Torch.gather_whole`,
each layer's gather and its gradient in torch's own ops), against
`keras-ops` (the Keras-ops form TensorFlow and JAX use,
`KerasFramework.gather_whole`), alternating.
"""

import argparse
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rounds, calls):
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import keras

    import kerasdist as kd
    from kerasdist.keras import framework as _framework
    from kerasdist.keras.sharding import layout as _layout
    from kerasdist.keras.sharding import step as _step
    from kerasdist.torch import _keras_layer

    kd.init()
    model = keras.Sequential(
        [keras.Input((3072,))]
        + [keras.layers.Dense(256, activation="relu") for _ in range(20)]
        + [keras.layers.Dense(10)])
    variables = model.trainable_variables
    framework = _framework.get()
    layout = _layout.Layout([v.shape for v in variables],
                            [v.dtype for v in variables], kd.size(),
                            bucket_bytes=1 << 20)
    shards = [_step.shard_of(framework, layout, v, i, kd.rank())
              for i, v in enumerate(variables)]
    default = _keras_layer.GATHER_AHEAD_BYTES
    times = {"ahead": [], "one": []}
    for r in range(rounds):
        for system, bound in (("ahead", default), ("one", 1)):
            _keras_layer.GATHER_AHEAD_BYTES = bound
            kd.allreduce(np.zeros(1, np.float32), name=f"meet.{system}.{r}")
            start = time.perf_counter()
            for _ in range(calls):
                _step.gather(framework, layout, shards, variables,
                             f"bench.{system}")
            times[system].append((time.perf_counter() - start) / calls)
    _keras_layer.GATHER_AHEAD_BYTES = default
    mine = [np.asarray(s).reshape(-1) for s in shards]
    everyone = [np.asarray(kd.allgather(m, name=f"check.{i}"))
                for i, m in enumerate(mine)]
    for i, v in enumerate(variables):
        whole = everyone[i][:layout.numels[i]].reshape(layout.shapes[i])
        np.testing.assert_array_equal(np.asarray(v.value.detach()), whole)
    steps = _weights_rounds(rounds, max(1, calls // 4))
    if kd.rank() == 0:
        _print(f"{len(variables)} variables, "
               f"{sum(layout.numels) / 1e6:.1f}M parameters, "
               f"{len(layout.buckets)} buckets, np={kd.size()}; ms a "
               f"gather over {rounds} rounds of {calls}", times, "one",
               "ahead")
        _print("ms a forward and backward under shard_weights", steps,
               "keras-ops", "torch")


def _print(title, times, slow, fast):
    print(f"# {title}")
    for system, values in times.items():
        ms = sorted(1e3 * t for t in values)
        print(f"{system:>9} median {ms[len(ms) // 2]:7.2f}  "
              f"range {ms[0]:.2f}-{ms[-1]:.2f}")
    ratio = sorted(o / a for o, a in zip(times[slow], times[fast]))
    print(f"{slow} / {fast}: median {ratio[len(ratio) // 2]:.2f}x  "
          f"range {ratio[0]:.2f}-{ratio[-1]:.2f}x")


def _weights_rounds(rounds, calls):
    import keras
    import numpy as np
    import torch

    import kerasdist as kd
    from kerasdist.keras import framework as _framework
    from kerasdist.torch import _keras_layer

    model = keras.Sequential(
        [keras.Input((3072,))]
        + [keras.layers.Dense(256, activation="relu") for _ in range(20)]
        + [keras.layers.Dense(10)])
    kd.shard_weights(model)
    x = torch.randn(64, 3072)
    native = _keras_layer.Torch.gather_whole
    forms = {"torch": native,
             "keras-ops": _framework.KerasFramework.gather_whole}
    times = {name: [] for name in forms}
    try:
        for r in range(rounds):
            for name, form in forms.items():
                _keras_layer.Torch.gather_whole = form
                kd.allreduce(np.zeros(1, np.float32), name=f"meet.w.{name}.{r}")
                start = time.perf_counter()
                for _ in range(calls):
                    model(x).sum().backward()
                times[name].append((time.perf_counter() - start) / calls)
    finally:
        _keras_layer.Torch.gather_whole = native
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--worker", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.rounds, args.calls)
        return
    env = dict(os.environ, KERAS_BACKEND="torch")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "kerasdist.run", "-np", str(args.np),
            sys.executable, os.path.abspath(__file__), "--worker",
            "--rounds", str(args.rounds), "--calls", str(args.calls)]
    sys.exit(subprocess.run(argv, env=env, cwd=REPO_ROOT,
                            timeout=900).returncode)


if __name__ == "__main__":
    main()
