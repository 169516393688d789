"""The largest model that trains under a fixed memory cap per rank, with the
replicated and the sharded optimizer (`DistributedOptimizer(shard=...)`).

    python benchmarks/memory_cap.py [--np 4] [--cap-mib 2048]
        [--width 1024] [--modes replicated,optimizer_state,gradients,
        weights,torch-ddp,torch-fsdp2,torch-fsdp2-meta]
        [--backend tensorflow]
        [--start-layers 1] [--most-layers 96] [--steps 3]

Needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory) or
cgroup v2 (memory.max). Each rank of a `kerasdist run -np N` job of
benchmarks/memory.py moves itself into a cgroup of its own whose limit is
--cap-mib (the process's whole resident set: the framework, the model,
the gradients, the optimizer state, the collectives' buffers); a rank
that goes over it is killed by the kernel's OOM killer, and the job fails.
`torch-ddp`, `torch-fsdp2` and `torch-fsdp2-meta` run PyTorch's DDP and
FSDP2 (each layer `fully_shard`ed; the model built whole, or on the meta
device) on the same model under torchrun (benchmarks/torch_zero.py),
each rank in its cgroup too.

For each mode the driver searches the deepest MLP (square Dense layers of
--width, Adam, batch 2 a rank) that trains --steps steps: doubling the
depth from --start-layers until a job fails, then bisecting. A job that
fails without an OOM kill in any rank's cgroup stops the benchmark with
its output. It prints
each trial and a table: the largest depth and parameter count per mode,
and the ratio to the replicated optimizer's.
"""

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
# PyTorch's own data parallelism and weight sharding on the same model
# (benchmarks/torch_zero.py, under torchrun): --modes torch-ddp,torch-fsdp2
PEERS = {"torch-ddp": "ddp", "torch-fsdp2": "fsdp2",
         "torch-fsdp2-meta": "fsdp2_meta"}
REPO_ROOT = os.path.dirname(BENCH)
V1 = "/sys/fs/cgroup/memory"
V2 = "/sys/fs/cgroup"


class Caps:
    """One memory cgroup per rank, `prefix`_r<rank>, each capped."""

    def __init__(self, n, cap_bytes):
        self.v1 = os.path.isdir(V1)
        root = V1 if self.v1 else V2
        if not self.v1 and not os.path.exists(
                os.path.join(V2, "cgroup.controllers")):
            sys.exit("memory_cap.py: no cgroup memory controller at "
                     f"{V1} or {V2}")
        self.prefix = os.path.join(root, f"kerasdist_cap{os.getpid()}")
        self.dirs = [f"{self.prefix}_r{r}" for r in range(n)]
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
            self._write(d, "memory.limit_in_bytes" if self.v1
                        else "memory.max", str(cap_bytes))
            if self.v1:
                self._write(d, "memory.memsw.limit_in_bytes", str(cap_bytes),
                            optional=True)

    @staticmethod
    def _write(d, name, value, optional=False):
        try:
            with open(os.path.join(d, name), "w") as f:
                f.write(value)
        except OSError:
            if not optional:
                raise

    def oom_kills(self):
        """OOM kills so far, summed over the ranks' cgroups."""
        total = 0
        for d in self.dirs:
            name = "memory.oom_control" if self.v1 else "memory.events"
            with open(os.path.join(d, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        total += int(value)
        return total

    def peak(self):
        """The highest usage any rank's cgroup reached, in bytes."""
        name = ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        best = 0
        for d in self.dirs:
            try:
                with open(os.path.join(d, name)) as f:
                    best = max(best, int(f.read().split()[0]))
            except (OSError, ValueError):
                pass
        return best

    def reset_peak(self):
        if self.v1:
            for d in self.dirs:
                self._write(d, "memory.max_usage_in_bytes", "0",
                            optional=True)

    def remove(self):
        for d in self.dirs:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    time.sleep(0.1)


def trial(args, caps, mode, depth):
    """(trained, peak bytes of the fullest rank) for `depth` layers."""
    params = depth * args.width * (args.width + 1)
    if mode in PEERS:  # PyTorch's own, under torchrun (torch_zero.py)
        cmd = [sys.executable, "-m", "torch.distributed.run",
               "--standalone", f"--nproc-per-node={args.np}",
               os.path.join(BENCH, "torch_zero.py"), "--rank",
               "--cgroup", caps.prefix, "--mode", PEERS[mode],
               "--width", str(args.width), "--params", str(params),
               "--steps", str(args.steps)]
    else:
        cmd = [sys.executable, "-m", "kerasdist.run", "-np", str(args.np),
               sys.executable, os.path.join(BENCH, "memory.py"), "--rank",
               "--cgroup", caps.prefix, "--mode", mode, "--model", "mlp",
               "--width", str(args.width), "--params", str(params),
               "--steps", str(args.steps)]
    env = dict(os.environ, KERAS_BACKEND=args.backend,
               TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=REPO_ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    if mode in PEERS:  # as torch_zero.py's driver: a share of the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.np))
    before = caps.oom_kills()
    caps.reset_peak()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                         timeout=3600)
    killed = caps.oom_kills() > before
    if out.returncode != 0 and not killed:
        sys.exit(f"{mode} at {depth} layers failed without an OOM kill "
                 f"({out.returncode}):\n" + (out.stdout + out.stderr)[-3000:])
    return out.returncode == 0, caps.peak()


def largest(args, caps, mode):
    """The deepest model that trains under the cap, by doubling then
    bisection; prints each trial."""
    good, bad, depth = 0, None, args.start_layers
    while depth <= args.most_layers:
        ok, peak = trial(args, caps, mode, depth)
        print(json.dumps({"mode": mode, "layers": depth, "trained": ok,
                          "peak_mib": round(peak / 2**20)}), flush=True)
        if not ok:
            bad = depth
            break
        good, depth = depth, depth * 2
    if bad is None:
        return good  # the cap was never reached: raise --most-layers
    while bad - good > 1:
        mid = (good + bad) // 2
        ok, peak = trial(args, caps, mode, mid)
        print(json.dumps({"mode": mode, "layers": mid, "trained": ok,
                          "peak_mib": round(peak / 2**20)}), flush=True)
        good, bad = (mid, bad) if ok else (good, mid)
    return good


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--cap-mib", type=int, default=2048)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--modes", default="replicated,optimizer_state,gradients")
    p.add_argument("--start-layers", type=int, default=1)
    p.add_argument("--most-layers", type=int, default=96)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="tensorflow")
    args = p.parse_args()
    caps = Caps(args.np, args.cap_mib * 2**20)
    found = {}
    try:
        for mode in args.modes.split(","):
            found[mode] = largest(args, caps, mode)
    finally:
        caps.remove()
    per_layer = args.width * (args.width + 1)
    ref = found.get("replicated")
    print(f"\nnp={args.np}, {args.cap_mib} MiB per rank, Dense({args.width}) "
          f"layers, Adam, {args.backend}")
    print("| optimizer | most layers | parameters | / replicated |")
    print("|---|---|---|---|")
    for mode, depth in found.items():
        ratio = f"{depth / ref:.2f}" if ref else "-"
        print(f"| {mode} | {depth} | {depth * per_layer / 1e6:.1f}M | "
              f"{ratio} |")


if __name__ == "__main__":
    main()
