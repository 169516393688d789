"""The peer's sharded optimizers, for benchmarks/memory.py's table: the
same MLP and batch in PyTorch with DDP (replicated), DDP +
`ZeroRedundancyOptimizer` (optimizer state sharded, ZeRO-1) and FSDP2
(`fully_shard` on each layer: weights, gradients and state sharded; the
model built whole, or with `fsdp2_meta` on the meta device), over gloo
on the CPU, launched by PyTorch's own torchrun. benchmarks/memory_cap.py
runs the DDP and FSDP2 rows under its memory cap.

    python benchmarks/torch_zero.py [--sizes 2,4] [--params 100e6]
        [--width 2048] [--steps 4] [--json FILE]

Each rank reports, as bytes per parameter (the max over ranks), as
memory.py does:

- held: this rank's weights + optimizer state after training, counted
  from the tensors (an FSDP2 weight counts its local shard); the
  gradients are not counted (memory.py's held has none either; DDP and
  ZeroRedundancyOptimizer keep whole gradients between steps, FSDP2
  sharded ones);
- peak: the peak resident set while training (VmHWM, started afresh once
  the model and the optimizer are built) above the process's resident set
  before the model was built.

Step time: the median step after the first, the slower rank's. Adam,
lr 1e-4, batch 2 a rank, float32; torch.set_num_threads gives each rank
its share of the CPUs, as `kerasdist run --bind` does. Rank 0 prints one
JSON line; the driver prints the table.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory  # noqa: E402  (the same RSS and peak readers)

MODES = ("ddp", "zero_redundancy", "fsdp2", "fsdp2_meta")


def _model(torch, width, params):
    depth = max(1, round(params / (width * (width + 1))))
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _local_numel(t):
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel()


def _wrap(torch, mode, model, n):
    """(model to train, optimizer) for `mode`. `fsdp2_meta`'s model is
    built on the meta device (no storage) and each rank then makes only
    its shards (`to_empty`, then each layer's own initializer), as
    FSDP2's documentation does for a model that does not fit one
    device; `fsdp2`'s is built whole first."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    if mode.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (n,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if mode == "fsdp2_meta":
            model.to_empty(device="cpu")
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    layer.reset_parameters()
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    ddp = DDP(model)
    if mode == "ddp":
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ddp, ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)


def _state_numel(torch, opt):
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's local one
    total = 0
    for per_param in inner.state.values():
        for v in per_param.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += _local_numel(v)
    return total


def rank_main(args):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    base = memory._rss_bytes()
    torch.manual_seed(0)
    if args.mode == "fsdp2_meta":
        with torch.device("meta"):
            model = _model(torch, args.width, args.params)
    else:
        model = _model(torch, args.width, args.params)
    n_params = sum(p.numel() for p in model.parameters())
    model, opt = _wrap(torch, args.mode, model, n)
    batch = 2
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch * args.steps, args.width, generator=gen)
    y = torch.randn(batch * args.steps, 1, generator=gen)
    memory._reset_peak()
    ends = []
    for s in range(args.steps):
        opt.zero_grad(set_to_none=True)
        xb, yb = x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        ends.append(time.perf_counter())
    held = sum(_local_numel(p) for p in model.parameters())
    held += _state_numel(torch, opt)
    steps = [b - a for a, b in zip(ends, ends[1:])]
    step = sorted(steps)[len(steps) // 2] if steps else float("nan")
    mine = torch.tensor([held * 4 / n_params,
                         (memory._peak_bytes() - base) / n_params, step],
                        dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    every = torch.stack(every)
    if rank == 0:
        print("RESULT " + json.dumps({
            "np": n, "mode": args.mode, "params": n_params,
            "held_bytes_per_param": float(every[:, 0].max()),
            "peak_bytes_per_param": float(every[:, 1].max()),
            "step_s": float(every[:, 2].max())}), flush=True)
    dist.destroy_process_group()


def drive(args):
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        for mode in MODES[:3]:
            cmd = [sys.executable, "-m", "torch.distributed.run",
                   "--standalone", f"--nproc-per-node={n}",
                   os.path.abspath(__file__), "--rank", "--mode", mode,
                   "--params", str(args.params), "--width", str(args.width),
                   "--steps", str(args.steps)]
            env = dict(os.environ, OMP_NUM_THREADS=str(
                max(1, (os.cpu_count() or 1) // n)))
            rows.append(memory.run_job(cmd, env, f"np={n} {mode}")[0])
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nPyTorch MLP, {rows[0]['params'] / 1e6:.1f}M parameters, Adam, "
          f"gloo; bytes per parameter (max over ranks)")
    print("| np | optimizer | held | peak RSS | step s | step / DDP |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ref = next(x for x in rows if x["np"] == r["np"]
                   and x["mode"] == "ddp")
        print(f"| {r['np']} | {r['mode']} | {r['held_bytes_per_param']:.2f} "
              f"| {r['peak_bytes_per_param']:.2f} | {r['step_s']:.3f} | "
              f"{r['step_s'] / ref['step_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cgroup", help=argparse.SUPPRESS)  # memory_cap.py's
    p.add_argument("--mode", choices=MODES, default="ddp")
    p.add_argument("--sizes", default="2,4")
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args()
    args.params = int(args.params)
    if args.rank:
        if args.cgroup:
            memory.join_cgroup(args.cgroup)
        rank_main(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
