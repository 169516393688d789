"""The sharded optimizer's allgather of the updated shards on PyTorch
(`kerasdist.keras.sharding.step.gather`, the end of every sharded step),
timed alone.

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
    if kd.rank() == 0:
        print(f"# {len(variables)} variables, "
              f"{sum(layout.numels) / 1e6:.1f}M parameters, "
              f"{len(layout.buckets)} buckets, np={kd.size()}; "
              f"ms a gather over {rounds} rounds of {calls}")
        for system, values in times.items():
            ms = sorted(1e3 * t for t in values)
            print(f"{system:>6} median {ms[len(ms) // 2]:7.2f}  "
                  f"range {ms[0]:.2f}-{ms[-1]:.2f}")
        ratio = sorted(o / a for o, a in zip(times["one"], times["ahead"]))
        print(f"one / ahead: median {ratio[len(ratio) // 2]:.2f}x  "
              f"range {ratio[0]:.2f}-{ratio[-1]:.2f}x")


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
