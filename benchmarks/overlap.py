"""Communication overlapping backprop: Keras fit with gradient buckets on
2 hosts x 1 rank of the test cluster (tests/cluster; needs root), the link
shaped to 1 Gbit (tc tbf).

    python benchmarks/overlap.py [--backend tensorflow] [--models mlp20,cnn]
        [--steps 20] [--rounds 3] [--buckets 1M] [--profile 1gbit]
        [--ranks-per-host 1] [--json FILE]

Per model (benchmarks/keras_scaling.py's CNN and MLP-20, batch 64 per
rank, SGD with momentum), the median step time of:

- compute only: one rank on one host, the plain optimizer (np=1); with
  `--ranks-per-host 2`, two ranks on one host each training alone (the
  compute of a step when two ranks share a host's cores and memory);
- no comm: every rank of the 2 hosts training alone at the same time
  (the plain optimizer, no collective): the compute of a step when the
  ranks share this machine's cores, memory and the links' CPU cost, as
  they do in the distributed runs (`/ no-comm t`: the target with it as
  the compute);
- comm only: the model's gradients (tensors of the trainable variables'
  shapes) allreduced alone, in one grouped allreduce per step, on the 2
  hosts;
- overlap off: `DistributedOptimizer(overlap=False)`: every gradient in
  one grouped allreduce after backprop;
- overlap: `DistributedOptimizer()` (buckets of the default size), and
  for each --buckets size `DistributedOptimizer(bucket_bytes=SIZE)`.

The target: a step no longer than max(compute, comm) + 0.5 x min(compute,
comm). The systems alternate round by round within one job; the step time
of a round is the median interval between batch ends after the warmup,
the slower rank's. `--backend jax` or `torch` runs the same on that Keras
backend (KERAS_BACKEND).
"""

import argparse
import json
import os
import sys
import time

import _common

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 3


# -- the ranks' side --------------------------------------------------------


def _step_times(model, data, steps):
    """Median seconds between batch ends of a fit of WARMUP + steps."""
    import keras

    ends = []
    timer = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: ends.append(time.perf_counter()))
    model.fit(data, steps_per_epoch=WARMUP + steps, epochs=1, verbose=0,
              callbacks=[timer])
    gaps = [b - a for a, b in zip(ends[WARMUP - 1:], ends[WARMUP:])]
    return _common.median(gaps)


def _comm_only(kd, model, backend):
    """A callable: the model's gradients' shapes allreduced in one grouped
    allreduce (as overlap off sends them), on the backend's tensors."""
    import numpy as np

    from kerasdist.keras import framework as _framework
    front = _framework.collectives()
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    arrays = [np.ones(s, np.float32) for s in shapes]
    if backend == "tensorflow":
        import tensorflow as tf
        tensors = [tf.constant(a) for a in arrays]

        @tf.function
        def step():
            out = front.grouped_allreduce(tensors, op=kd.Average,
                                          name="ovb.comm")
            return out[0][..., :1]
        return lambda: step().numpy()
    if backend == "jax":
        import jax
        tensors = [jax.numpy.asarray(a) for a in arrays]

        @jax.jit
        def step(xs):
            return front.grouped_allreduce(xs, op=kd.Average,
                                           name="ovb.comm")[0]
        return lambda: jax.block_until_ready(step(tensors))
    import torch
    tensors = [torch.from_numpy(a) for a in arrays]
    return lambda: front.grouped_allreduce(tensors, op=kd.Average,
                                           name="ovb.comm")


def rank_job(opts):
    import keras_scaling as ks
    from mpi4py import MPI
    ks._threads(opts["backend"])
    import keras
    import numpy as np

    import kerasdist as kd
    comm = MPI.COMM_WORLD
    kd.init()
    rank, n = kd.rank(), kd.size()
    together = n > 1 and not opts.get("alone")
    rng = np.random.default_rng(rank)
    x = rng.random((1024, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(1024,))
    if opts["backend"] == "tensorflow":
        import tensorflow as tf
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            ks.BATCH).prefetch(2)
    else:
        data = ks._batches(x, y)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    jit = opts["backend"] == "jax"
    models = {}
    for name, kw in opts["systems"].items():
        model = ks._build(opts["model"])
        sgd = keras.optimizers.SGD(0.01, momentum=0.9)
        opt = sgd if kw is None else kd.DistributedOptimizer(
            sgd, name=f"ovb{len(models)}", **kw)
        model.compile(optimizer=opt, loss=loss, jit_compile=jit)
        if together:
            kd.broadcast_variables(model.variables, root_rank=0)
        model.fit(data, steps_per_epoch=WARMUP, epochs=1, verbose=0)
        models[name] = model
    comm_step = _comm_only(kd, models[next(iter(models))],
                           opts["backend"]) if together else None
    res = {name: [] for name in models}
    if comm_step is not None:
        res["comm only"] = []
        for _ in range(WARMUP):
            comm_step()
    names = list(res)
    for r in range(opts["rounds"]):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            comm.Barrier()
            if name == "comm only":
                times = []
                for _ in range(opts["steps"]):
                    t0 = time.perf_counter()
                    comm_step()
                    times.append(time.perf_counter() - t0)
                sec = _common.median(times)
            else:
                sec = _step_times(models[name], data, opts["steps"])
            res[name].append(max(comm.allgather(sec)))
    out = {name: _common.median(v) for name, v in res.items()}
    out["tensors"] = len(models[names[0]].trainable_variables)
    out["grad_bytes"] = int(sum(np.prod(v.shape) * 4 for v in
                                models[names[0]].trainable_variables))
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


# -- the machine's side -----------------------------------------------------


def job(cluster, np_, hosts, opts, env, timeout=900):
    from tests.support.helpers import launch
    from tests.support.helpers import rank_lines
    argv = [sys.executable, os.path.abspath(__file__), "_rank",
            json.dumps(opts)]
    out = launch(np_, argv, timeout=timeout, env=env,
                 prefix=cluster.launcher_prefix(),
                 launcher_args=["--ssh-command", cluster.remote_shell,
                                "--network-interface", cluster.bridge,
                                "-H", hosts])
    lines = [line for line in rank_lines(out.stdout, 0)
             if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"job failed (code {out.returncode}):\n"
                         + out.stdout[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_rank":
        _common.quiet_tf()
        return rank_job(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="tensorflow",
                   choices=["tensorflow", "jax", "torch"])
    p.add_argument("--models", default="mlp20,cnn")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--buckets", default="1M",
                   help="bucket sizes besides the default (K/M suffix; "
                        "empty: none)")
    p.add_argument("--profile", default="1gbit")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks on each of the 2 hosts (2 x N)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    from tests.support.cluster import Cluster
    from tests.support.cluster import unavailable_reason
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"overlap.py needs a test cluster: {reason}")
    systems = {"overlap off": {"overlap": False}, "overlap": {"overlap": True}}
    for size in filter(None, args.buckets.split(",")):
        systems[f"overlap {size}"] = {"overlap": True,
                                      "bucket_bytes": _common.parse_size(size)}
    env = dict(os.environ, KERAS_BACKEND=args.backend)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    if args.backend == "jax":
        env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                       "intra_op_parallelism_threads=1")
    results = {}
    cluster = Cluster(2)
    try:
        for h in cluster.hosts:
            cluster.shape(h, args.profile)
        for model in args.models.split(","):
            common = {"backend": args.backend, "model": model,
                      "steps": args.steps, "rounds": args.rounds}
            k = args.ranks_per_host
            hosts = f"kdt0:{k},kdt1:{k}"
            alone = job(cluster, k, f"kdt0:{k}",
                        dict(common, systems={"compute only": None},
                             alone=True), env)
            apart = job(cluster, 2 * k, hosts,
                        dict(common, systems={"no comm": None},
                             alone=True), env)
            two = job(cluster, 2 * k, hosts,
                      dict(common, systems=systems), env)
            results[model] = {**alone, **apart, **two}
            report(model, results[model], systems, args)
    finally:
        cluster.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


def report(model, res, systems, args):
    compute, comm = res["compute only"], res["comm only"]
    target = max(compute, comm) + 0.5 * min(compute, comm)
    apart = res["no comm"]
    shared = max(apart, comm) + 0.5 * min(apart, comm)
    print(f"# {model} ({res['tensors']} tensors, {res['grad_bytes']} B), "
          f"{args.backend}, 2 hosts x {args.ranks_per_host} rank(s), "
          f"{args.profile}; median step "
          f"over {args.rounds} rounds of {args.steps}; target max(compute, "
          f"comm) + 0.5 min = {target * 1e3:.1f} ms; with the no-comm "
          f"step as compute: {shared * 1e3:.1f} ms")
    print(f"{'system':>16} {'step ms':>9} {'/ target':>9} {'/ no-comm t':>12}"
          f" {'/ off':>7}")
    off = res["overlap off"]
    for name in ["compute only", "no comm", "comm only", *systems]:
        sec = res[name]
        print(f"{name:>16} {sec * 1e3:>9.1f} {sec / target:>9.2f} "
              f"{sec / shared:>12.2f} {sec / off:>7.2f}")
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
