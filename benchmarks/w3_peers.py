"""W3 peers: what each backend's own data-parallel system adds per step at
np=2, for the models and batch of benchmarks/keras_scaling.py.

    python benchmarks/w3_peers.py [--systems ddp,keras-dp] [--models mlp20,cnn]
        [--steps 60] [--warmup 10] [--rounds 1]

- `ddp`: plain PyTorch (no Keras): `torch.nn.parallel.DistributedDataParallel`
  over gloo on loopback, the same MLP-20 / CNN layer for layer (the same
  gradient bytes), SGD(0.01, momentum 0.9), cross entropy, one thread;
  np=1 is the module without DDP.
- `keras-dp`: Keras on JAX with `keras.distribution.DataParallel` over
  `jax.distributed` (two CPU processes, gloo collectives), each process
  feeding its 64 images; np=1 is plain Keras on JAX (jitted).

- `kerasdist-torch`, `kerasdist-jax`: kerasdist's Keras job of
  benchmarks/keras_scaling.py on that backend (np=1 and np=2), in the same
  rounds as the peers: `--systems ddp,kerasdist-torch` alternates them.
  Its step is 64 / the slower rank's img/s.

Each rank times `--steps` steps after `--warmup`, by wall clock; the row
gives the median step time at np=1 and np=2, the milliseconds np=2 adds
and the efficiency (np=1 step time / np=2 step time: total images/s at
np=2 over twice np=1's). Compare with keras_scaling.py's kerasdist rows
(`--backends jax,torch`), which print the same quantities. Run it alone:
the machine has 2 cores.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

BATCH = 64


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- PyTorch DDP -------------------------------------------------------------


def _torch_model(name):
    import torch.nn as nn
    if name == "mlp20":
        layers = [nn.Flatten(), nn.Linear(32 * 32 * 3, 256), nn.ReLU()]
        for _ in range(19):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        layers += [nn.Linear(256, 10)]
        return nn.Sequential(*layers)
    layers, cin = [], 3
    for filters in (32, 64, 128):
        layers += [nn.Conv2d(cin, filters, 3, padding=1), nn.ReLU(),
                   nn.Conv2d(filters, filters, 3, padding=1), nn.ReLU(),
                   nn.MaxPool2d(2)]
        cin = filters
    layers += [nn.Flatten(), nn.Linear(128 * 4 * 4, 384), nn.ReLU(),
               nn.Linear(384, 10)]
    return nn.Sequential(*layers)


def ddp_worker(model_name, steps, warmup, rank, world, port):
    import torch
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    model = _torch_model(model_name)
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    x = torch.rand((1024, 3, 32, 32), generator=g)
    y = torch.randint(0, 10, (1024,), generator=g)
    times = []
    for step in range(warmup + steps):
        i = (step * BATCH) % 1024
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[i:i + BATCH]), y[i:i + BATCH])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    return statistics.median(times[warmup:]) * 1000


# ---- Keras DataParallel on JAX -----------------------------------------------


def keras_dp_worker(model_name, steps, warmup, rank, world, port):
    import jax
    if world > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world,
                                   process_id=rank)
    import keras
    import numpy as np
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from keras_scaling import _build
    if world > 1:
        dp = keras.distribution.DataParallel(devices=jax.devices())
        dp.auto_shard_dataset = False  # each process feeds its own batch
        keras.distribution.set_distribution(dp)
    # The same initial weights on every process (the variables are
    # replicated: jax checks they agree).
    keras.utils.set_random_seed(0)
    model = _build(model_name)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), jit_compile=True)
    rng = np.random.default_rng(rank)
    x = rng.random((1024, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(1024,))
    ends = []
    timer = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(
            time.perf_counter()))

    def batches():
        while True:
            for i in range(0, 1024, BATCH):
                yield x[i:i + BATCH], y[i:i + BATCH]

    model.fit(batches(), steps_per_epoch=warmup + steps, epochs=1,
              verbose=0, callbacks=[timer])
    gaps = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    return statistics.median(gaps) * 1000


WORKERS = {"ddp": ddp_worker, "keras-dp": keras_dp_worker}
# kerasdist's own rows (benchmarks/keras_scaling.py's job, on that Keras
# backend), so that a peer and kerasdist alternate in the same rounds.
KERASDIST = {"kerasdist-torch": "torch", "kerasdist-jax": "jax"}


def _run_kerasdist(backend, model, world, steps, warmup):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import keras_scaling
    res = keras_scaling._launch(world, model, steps, warmup,
                                backend=backend)
    if not res["same"]:
        raise RuntimeError(f"kerasdist on {backend}: the ranks' weights "
                           "differ after training")
    return max(BATCH * 1000.0 / r for r in res["rates"])


def _run(system, model, world, steps, warmup):
    if system in KERASDIST:
        return _run_kerasdist(KERASDIST[system], model, world, steps, warmup)
    port = _port()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if system == "keras-dp":
        env["KERAS_BACKEND"] = "jax"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_"
                            "thread_eigen=false intra_op_parallelism_"
                            "threads=1").strip()
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", system,
         "--model", model, "--rank", str(r), "--world", str(world),
         "--port", str(port), "--steps", str(steps), "--warmup",
         str(warmup)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env) for r in range(world)]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"{system} {model} np={world} failed:\n"
                                   f"{out[-3000:]}")
            results.append(json.loads(lines[-1][7:])["step_ms"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return max(results)  # the step ends when the slower rank's does


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp20", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1,
                        help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--systems", default="ddp,keras-dp")
    parser.add_argument("--models", default="mlp20,cnn")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        ms = WORKERS[args.worker](args.model, args.steps, args.warmup,
                                  args.rank, args.world, args.port)
        print("RESULT " + json.dumps({"step_ms": ms}), flush=True)
        return
    print("| model | system | np=1 ms/step | np=2 ms/step | ms added at np=2 "
          "(range over rounds) | efficiency |")
    print("|---|---|---|---|---|---|")
    systems = args.systems.split(",")
    for model in args.models.split(","):
        one = {s: [] for s in systems}
        two = {s: [] for s in systems}
        for _ in range(args.rounds):  # every system once per round
            for system in systems:
                one[system].append(_run(system, model, 1, args.steps,
                                        args.warmup))
                two[system].append(_run(system, model, 2, args.steps,
                                        args.warmup))
        for system in systems:
            a, b = statistics.median(one[system]), statistics.median(
                two[system])
            added = sorted(y - x for x, y in zip(one[system], two[system]))
            print(f"| {model} | {system} | {a:.1f} | {b:.1f} | {b - a:.1f} "
                  f"({added[0]:.1f}..{added[-1]:.1f}) | {a / b:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
