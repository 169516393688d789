"""W4: one allreduce's latency through the JAX and PyTorch front ends.

    python -m kerasdist.run -np 2 python benchmarks/frontends.py \
        [--sizes 4K,1M] [--rounds 5]

For each size (float32, Sum), in the same run and alternating round by
round:

- raw MPI: mpi4py `comm.Allreduce` on numpy buffers (the transport);
- kerasdist jax.jit: `kerasdist.jax.allreduce` inside a jitted function
  (the XLA FFI handler on the CPU), one call and `block_until_ready` per
  timed unit;
- kerasdist torch eager: `kerasdist.torch.allreduce` on a CPU tensor.

Each call is timed on its own after a barrier; the figure is the median over
all calls of the per-call maximum across ranks, in the table of allreduce.py
(`ratio` = time / raw MPI's). benchmarks/ab_builds.py collects it as "fe".
Front ends that are not installed are left out.
"""

import argparse

import _common
import numpy as np

DEFAULT_SIZES = "4K,1M"
RAW = "raw MPI"


def _calls_for(nbytes):
    return 100 if nbytes <= 64 * _common.KIB else 40


def make_systems(comm, nbytes, jkd, tkd):
    """name -> (one-call callable, check callable returning #wrong)."""
    from mpi4py import MPI

    rank, n = comm.Get_rank(), comm.Get_size()
    x = np.full(nbytes // 4, rank + 1, np.float32)
    out = np.empty_like(x)
    want = np.float32(n * (n + 1) // 2)
    last = {}

    def raw():
        comm.Allreduce(x, out, op=MPI.SUM)

    systems = {RAW: (raw, lambda: int(np.count_nonzero(out != want)))}
    if jkd is not None:
        import jax
        import jax.numpy as jnp

        jx = jnp.asarray(x)
        jitted = jax.jit(lambda t: jkd.allreduce(t, op=jkd.Sum))

        def in_jit():
            last["j"] = jitted(jx)
            last["j"].block_until_ready()

        systems["kerasdist jax.jit"] = (
            in_jit,
            lambda: int(np.count_nonzero(np.asarray(last["j"]) != want)))
    if tkd is not None:
        import torch

        tx = torch.from_numpy(x.copy())
        name = f"w4.{nbytes}.torch"

        def torch_eager():
            last["t"] = tkd.allreduce(tx, op=tkd.Sum, name=name)

        systems["kerasdist torch eager"] = (
            torch_eager,
            lambda: int(np.count_nonzero(last["t"].numpy() != want)))
    return systems


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="comma-separated sizes in bytes (K/M suffixes)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from mpi4py import MPI  # initialises MPI (THREAD_MULTIPLE) first

    jkd = tkd = None
    try:
        import kerasdist.jax as jkd
    except ImportError as e:
        print(f"# no JAX front end ({e}): its row is left out", flush=True)
    try:
        import torch

        torch.set_num_threads(1)  # np=2 on 2 cores leaves no spare
        import kerasdist.torch as tkd
    except ImportError as e:
        print(f"# no PyTorch front end ({e}): its row is left out", flush=True)
    (jkd or tkd).init()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    factor = _common.busbw_factor("allreduce", n)
    if rank == 0:
        print(f"# W4 allreduce float32 Sum through the front ends, np={n}, "
              f"median of per-call times over {args.rounds} alternating "
              f"rounds; ratio = time / {RAW}", flush=True)
        print(_common.TABLE_HEAD, flush=True)
    for nbytes in (_common.parse_size(s) for s in args.sizes.split(",")):
        systems = make_systems(comm, nbytes, jkd, tkd)
        wrong = {}
        for name, (call, check) in systems.items():
            call()
            wrong[name] = check()
        samples = _common.agree(comm, _common.alternate(
            {k: v[0] for k, v in systems.items()}, args.rounds,
            _calls_for(nbytes), comm))
        if rank == 0:
            base = _common.median(samples[RAW])
            for name in systems:
                sec = _common.median(samples[name])
                print(_common.table_row(nbytes, nbytes // 4, "float", name,
                                        sec, factor, wrong[name], sec / base),
                      flush=True)
    (jkd or tkd).shutdown()


if __name__ == "__main__":
    main()
