"""A cost model of data-parallel training with ring allreduce and fusion.

    python benchmarks/scaling_model.py                 # paper check + table
    python benchmarks/scaling_model.py --plot docs/img/scaling_model.png
    python -m kerasdist.run -np 2 python benchmarks/scaling_model.py --measure

One training step on n workers = forward + backward compute (as on one
worker) + whatever part of the gradient allreduce is not hidden behind the
backward pass. The model, step by step:

1. Compute: t_c = batch / single-worker throughput; the backward pass is
   the last `backward_frac` of it. Gradients (T tensors of equal size) become
   ready evenly over the backward pass.
2. Fusion: ready gradients are packed in order into buffers of at most
   `fusion_bytes`; a buffer leaves when its last tensor is ready (plus the
   runtime's batching window, `cycle_s`).
3. Network: buffers go one after another (one ring at a time). A ring
   allreduce of S bytes on n workers costs 2(n-1) alpha + 2(n-1)/n S beta
   (Patarasuk & Yuan; Horovod's and NCCL's ring), plus `per_tensor_s` for
   each tensor in the buffer (the runtime's bookkeeping and copies).
4. Step time = max(t_c, end of the last buffer); scaling efficiency =
   t_c / step time.

alpha (seconds per message per hop) and beta (seconds per byte on the
slowest link) come from a network's data sheet times an achieved fraction,
or from a measurement here (`--measure`: fitted to raw MPI allreduce times
at several sizes, with kerasdist's per-tensor overhead taken from a fused
128-tensor step). Standard library only, except `--plot` (matplotlib) and
`--measure` (mpi4py, numpy, kerasdist).
"""

import argparse
import dataclasses
import os
import sys


@dataclasses.dataclass(frozen=True)
class Network:
    """A network: latency alpha (s per message per hop), beta (s per byte)."""

    name: str
    alpha: float
    beta: float

    @classmethod
    def from_rate(cls, name, gbit_per_s, achieved, alpha):
        """From a line rate in Gbit/s and the fraction of it achieved."""
        return cls(name, alpha, 1.0 / (gbit_per_s * 1e9 / 8 * achieved))


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model: parameters, gradient tensors, single-worker images/s."""

    name: str
    params: float
    tensors: int
    img_per_s: float
    batch: int = 64
    bytes_per_param: int = 4

    @property
    def grad_bytes(self):
        return self.params * self.bytes_per_param

    @property
    def compute_s(self):
        return self.batch / self.img_per_s


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The allreduce runtime's knobs and costs."""

    name: str
    fusion_bytes: float = 64 * 2**20
    per_tensor_s: float = 0.0
    cycle_s: float = 0.0


# The Horovod paper (Sergeev & Del Balso, arXiv:1802.05799), Fig. 6/7: 128
# Pascal GPUs (32 servers x 4 P100), 25 GbE, tf_cnn_benchmarks, batch 64 per
# GPU. Parameter counts from the models' definitions; single-P100
# throughputs from TensorFlow's published tf_cnn_benchmarks results of the
# time (ResNet-101 interpolated between ResNet-50 and ResNet-152 by FLOPs).
PAPER_WORKLOADS = (
    Workload("Inception V3", 23.8e6, 196, 142.0),
    Workload("ResNet-101", 44.5e6, 314, 125.0),
    Workload("VGG-16", 138.4e6, 32, 144.0),
)
# Scaling efficiency read from the paper's figures (Fig. 6 TCP; "about 88%"
# for Inception V3 and ResNet-101; VGG-16 far lower, RDMA helping it ~30%).
PAPER_EFFICIENCY = {"Inception V3": 0.88, "ResNet-101": 0.88}
# TCP over 25 GbE reaches roughly 75% of line rate with ~25 us per message;
# RDMA (RoCE) ~90% with ~5 us. Horovod 0.9 (the paper's): 64 MiB fusion,
# a 5 ms cycle, ~25 us per tensor (measured on 0.28 here, BENCHMARKS.md).
TCP_25G = Network.from_rate("25 GbE TCP", 25, 0.75, 25e-6)
RDMA_25G = Network.from_rate("25 GbE RDMA", 25, 0.90, 5e-6)
HOROVOD_2017 = Runtime("Horovod (paper)", 64 * 2**20, 25e-6, 5e-3)


def ring_allreduce_s(nbytes, n, net):
    """Ring allreduce time of `nbytes` on `n` workers."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * net.alpha + 2.0 * (n - 1) / n * nbytes * net.beta


def fusion_buffers(tensor_bytes, count, fusion_bytes):
    """Sizes (bytes, tensors) of the buffers `count` equal tensors fill, in
    order. A tensor larger than the threshold goes alone."""
    buffers, cur_b, cur_n = [], 0.0, 0
    for _ in range(count):
        if cur_n and cur_b + tensor_bytes > fusion_bytes:
            buffers.append((cur_b, cur_n))
            cur_b, cur_n = 0.0, 0
        cur_b += tensor_bytes
        cur_n += 1
    if cur_n:
        buffers.append((cur_b, cur_n))
    return buffers


def step_time_s(work, n, net, rt, backward_frac=2.0 / 3.0):
    """One training step's wall time on n workers (see the module doc)."""
    t_c = work.compute_s
    if n <= 1:
        return t_c
    t_back0 = t_c * (1.0 - backward_frac)
    t_back = t_c * backward_frac
    size = work.grad_bytes / work.tensors
    free, done_tensors = 0.0, 0
    for nbytes, count in fusion_buffers(size, work.tensors, rt.fusion_bytes):
        done_tensors += count
        ready = t_back0 + t_back * done_tensors / work.tensors + rt.cycle_s
        start = max(ready, free)
        free = (start + ring_allreduce_s(nbytes, n, net)
                + count * rt.per_tensor_s)
    return max(t_c, free)


def efficiency(work, n, net, rt, **kw):
    """Scaling efficiency: single-worker step time / n-worker step time."""
    return work.compute_s / step_time_s(work, n, net, rt, **kw)


def fit_alpha_beta(sizes, seconds, n):
    """Least-squares fit of t = 2(n-1) alpha + 2(n-1)/n S beta.

    Args:
        sizes: message sizes in bytes.
        seconds: measured allreduce times for them.
        n: the number of ranks they were measured on (>= 2).

    Returns:
        (alpha, beta), clipped at zero.
    """
    if n < 2 or len(sizes) < 2:
        raise ValueError(f"need n >= 2 and two sizes, got n={n}, "
                         f"{len(sizes)} sizes.")
    xs = [2.0 * (n - 1) / n * s for s in sizes]
    k = len(xs)
    mx, my = sum(xs) / k, sum(seconds) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / sxx
    a = my - beta * mx
    return max(a / (2 * (n - 1)), 0.0), max(beta, 0.0)


def measure(rounds=5):
    """Measures alpha, beta (raw MPI) and kerasdist's per-tensor cost here.

    Run under the launcher with np >= 2. Returns (Network, per_tensor_s) on
    every rank.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import _common
    import fusion
    import numpy as np
    from mpi4py import MPI
    tf = _common.tf_single_thread()
    import kerasdist as kd
    kd.init()
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    sizes = [4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20]
    times = []
    for s in sizes:
        x = np.ones(s // 4, np.float32)
        y = np.empty_like(x)
        got = _common.agree(comm, _common.alternate(
            {"raw": lambda: comm.Allreduce(x, y, op=MPI.SUM)}, rounds, 20,
            comm))
        times.append(_common.median(got["raw"]))
    alpha, beta = fit_alpha_beta(sizes, times, n)
    res = fusion.run_case(comm, kd, tf, 128, 16 * 2**10, rounds, 10)
    per_tensor = max(0.0, (res["kerasdist core (ctypes)"][0]
                           - res["raw MPI one buffer"][0]) / 128)
    return Network("measured here (shared memory)", alpha, beta), per_tensor


def paper_table(net=TCP_25G, rt=HOROVOD_2017, n=128):
    rows = []
    for w in PAPER_WORKLOADS:
        rows.append((w, efficiency(w, n, net, rt),
                     efficiency(w, n, RDMA_25G, rt),
                     PAPER_EFFICIENCY.get(w.name)))
    return rows


def print_paper_table(net=TCP_25G, rt=HOROVOD_2017):
    print(f"# Horovod paper setting: 128 GPUs, {net.name} (alpha "
          f"{net.alpha * 1e6:.0f} us, {1 / net.beta / 1e9:.2f} GB/s) and "
          f"{RDMA_25G.name}; {rt.name}: fusion "
          f"{rt.fusion_bytes / 2**20:.0f} MiB, cycle {rt.cycle_s * 1e3:g} ms, "
          f"{rt.per_tensor_s * 1e6:g} us/tensor")
    print(f"# {'model':<13}{'params':>8}{'grad MB':>9}{'step ms':>9}"
          f"{'eff TCP':>9}{'eff RDMA':>10}{'paper':>7}")
    for w, e_tcp, e_rdma, paper in paper_table(net, rt):
        p = f"{paper:.2f}" if paper else "  low"
        print(f"  {w.name:<13}{w.params / 1e6:>7.1f}M"
              f"{w.grad_bytes / 1e6:>9.0f}{w.compute_s * 1e3:>9.0f}"
              f"{e_tcp:>9.2f}{e_rdma:>10.2f}{p:>7}")


RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)


def kerasdist_runtime(per_tensor_s):
    return Runtime("kerasdist", 64 * 2**20, per_tensor_s, 0.0)


def prediction_table(per_tensor_s, nets=(TCP_25G, RDMA_25G)):
    """{(network name, model name): [efficiency at each of RANKS]}."""
    rt = kerasdist_runtime(per_tensor_s)
    return {(net.name, w.name): [efficiency(w, n, net, rt) for n in RANKS]
            for net in nets for w in PAPER_WORKLOADS}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--measure", action="store_true",
                   help="measure alpha, beta and per-tensor cost here "
                        "(run under kerasdist.run -np 2)")
    p.add_argument("--per-tensor-us", type=float, default=5.0,
                   help="kerasdist's per-tensor cost for the prediction "
                        "(default 5; --measure replaces it)")
    p.add_argument("--alpha-us", type=float,
                   help="a network's alpha for the prediction")
    p.add_argument("--gbps", type=float,
                   help="a network's achieved bandwidth (GB/s) for the "
                        "prediction")
    p.add_argument("--plot", help="write the prediction plot here")
    args = p.parse_args(argv)
    per_tensor = args.per_tensor_us * 1e-6
    nets = [TCP_25G, RDMA_25G]
    if args.measure:
        net, per_tensor = measure()
        import kerasdist as kd
        if kd.rank() != 0:
            return 0
        print(f"# measured here: alpha {net.alpha * 1e6:.2f} us, beta "
              f"{net.beta * 1e9:.3f} ns/B ({1 / net.beta / 1e9:.2f} GB/s), "
              f"kerasdist per tensor {per_tensor * 1e6:.1f} us")
        nets.append(net)
    if args.alpha_us is not None and args.gbps is not None:
        nets.append(Network("given", args.alpha_us * 1e-6,
                            1.0 / (args.gbps * 1e9)))
    print_paper_table()
    print()
    table = prediction_table(per_tensor, nets)
    print(f"# kerasdist prediction (64 MiB fusion, no cycle wait, "
          f"{per_tensor * 1e6:.1f} us/tensor): scaling efficiency")
    print(f"# {'network':<32}{'model':<14}"
          + "".join(f"{n:>7}" for n in RANKS))
    for (net_name, model), effs in table.items():
        print(f"  {net_name:<32}{model:<14}"
              + "".join(f"{e:>7.2f}" for e in effs))
    if args.plot:
        plot(args.plot, table)
    return 0


def plot(path, table):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":", "-."]
    nets = sorted({k[0] for k in table}, key=list(k[0] for k in table).index)
    for (net_name, model), effs in table.items():
        ax.plot(RANKS, effs, styles[nets.index(net_name) % 4], marker="o",
                markersize=3, label=f"{model}, {net_name}")
    for w, e_tcp, _, paper in paper_table():
        if paper:
            ax.plot([128], [paper], "k*", markersize=9)
    ax.plot([], [], "k*", label="Horovod paper, 128 GPUs")
    ax.set_xscale("log", base=2)
    ax.set_xticks(RANKS)
    ax.set_xticklabels([str(n) for n in RANKS])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency")
    ax.set_title("Ring allreduce + fusion cost model (batch 64 per worker)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"# wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
