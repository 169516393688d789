"""Two builds of kerasdist against each other, alternating, in one run.

    python benchmarks/ab_builds.py OLD_TREE NEW_TREE [--rounds 5]
        [--w3-rounds 3] [--skip w1,w2,w3,fe] [--w3-backends tensorflow,jax]
        [--w3-shard] [--w3-models mlp20]
        [--old-env NAME=VALUE ...] [--new-env NAME=VALUE ...]

The two sides may be one tree with different settings: e.g. the
heartbeat's cost is `ab_builds.py . . --old-env
KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=0` (old: off, new: on).

Each tree is a checkout with its native libraries built in place (`make -C
ops OUT=$PWD/kerasdist`). Round by round, in alternating order, each tree
runs its own benchmark scripts with `--rounds 1`: W1 (allreduce.py, without
its W2 part), W2 (fusion.py), W3 (keras_scaling.py, CNN and MLP-20, np=1
and 2) and "fe" (frontends.py: the JAX and PyTorch front ends' allreduce;
a tree older than that script needs a copy of it in its benchmarks/, or
`--skip fe`). Every table row (size and system for W1/W2; model, system
and np for W3) is collected per tree; the summary gives each tree's median
with its range over the rounds, and new / old. A ratio within the rounds'
spread is noise: this machine drifts by 5-20% over minutes, which is why
the trees alternate and only the ratio of medians taken in one run means
anything.

Run it alone, as root on the machine the benchmarks describe.
"""

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys

_NUM = r"[-+0-9.e]+|nan|inf"
# W1/W2 rows: size count type system time algbw busbw #wrong [ratio]
_TABLE = re.compile(rf"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(.+?)\s+"
                    rf"({_NUM})\s+({_NUM})\s+"
                    rf"({_NUM})\s+(\d+)(?:\s+({_NUM}))?\s*$")
# W3 rows: model system params tensors np img/s/rank total eff range same
_W3 = re.compile(r"^\s*(\w+)\s+([\w-]+)\s+\d+\s+\d+\s+(\d)\s+"
                 r"([0-9.]+)\s+([0-9.]+)"
                 r"\s+([0-9.]+)\s+\S+\s+(True|False)\s*$")


def _run(tree, argv, timeout, extra_env=None):
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="3",
               **(extra_env or {}))
    p = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if os.environ.get("AB_KEEP"):
        with open(os.environ["AB_KEEP"], "a") as f:
            f.write(f"### {tree}: {' '.join(argv)}\n{p.stdout}\n")
    if p.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed in {tree} (exit {p.returncode}):\n"
                 + (p.stdout + p.stderr)[-3000:])
    return p.stdout


def _launch(script, *args):
    return [sys.executable, "-m", "kerasdist.run", "-np", "2", sys.executable,
            script, "--rounds", "1", *args]


_PREFIX = re.compile(r"^\[\d+\]<std(?:out|err)>:")


def collect_tables(out, section, into):
    """Adds W1/W2 rows (time in us) of `out` to into[(section, size, system)]
    (rank 0 prints them; the launcher prefixes each line with its rank)."""
    for line in out.splitlines():
        m = _TABLE.match(_PREFIX.sub("", line))
        if m and int(m.group(8)) == 0:
            into[(section, int(m.group(1)), m.group(4).strip())].append(
                float(m.group(5)))
        elif m:
            sys.exit(f"a {section} row reports wrong results: {line}")


def collect_w3(out, into):
    """Adds W3 rows (total img/s, and eff) to
    into[("w3", model, system, np)]."""
    for line in out.splitlines():
        m = _W3.match(line)
        if m:
            key = ("w3", m.group(1), m.group(2), int(m.group(3)))
            into[key + ("img/s",)].append(float(m.group(5)))
            into[key + ("eff",)].append(float(m.group(6)))


def one_round(tree, skip, into, env=None, w3_backends="tensorflow",
              w3_args=()):
    bench = os.path.join(tree, "benchmarks")
    if "w1" not in skip:
        out = _run(tree,
                   _launch(os.path.join(bench, "allreduce.py"), "--no-fusion"),
                   1200, env)
        collect_tables(out, "w1", into)
    if "w2" not in skip:
        out = _run(tree, _launch(os.path.join(bench, "fusion.py")), 1200, env)
        collect_tables(out, "w2", into)
    if "fe" not in skip:
        script = os.path.join(bench, "frontends.py")
        if not os.path.exists(script):
            sys.exit(f"{script} is missing: copy benchmarks/frontends.py "
                     "into that tree, or pass --skip fe.")
        out = _run(tree, _launch(script), 1200, env)
        collect_tables(out, "fe", into)
    if "w3" not in skip:
        out = _run(tree,
                   [sys.executable, os.path.join(bench, "keras_scaling.py"),
                    "--rounds", "1", "--backends", w3_backends,
                    *w3_args], 2400, env)
        collect_w3(out, into)


def _fmt(values):
    if not values:
        return "-"
    return (f"{statistics.median(values):.4g} "
            f"({min(values):.4g}-{max(values):.4g})")


def summary(results, old, new):
    keys = sorted(set(results[0]) | set(results[1]), key=str)
    print(f"# old = {old}\n# new = {new}")
    print("# W1/W2: time(us) of one allreduce / one step; W3: total img/s and "
          "efficiency; medians (range) over the rounds; new/old of the medians")
    for k in keys:
        a, b = results[0].get(k, []), results[1].get(k, [])
        ratio = (statistics.median(b) / statistics.median(a)
                 if a and b and statistics.median(a) else float("nan"))
        name = " ".join(str(x) for x in k)
        print(f"{name:<58} {_fmt(a):>28} {_fmt(b):>28} {ratio:>7.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--w3-rounds", type=int, default=3,
                   help="rounds that include W3 (the slowest), from the first")
    p.add_argument("--skip", default="", help="comma-separated: w1,w2,w3,fe")
    p.add_argument("--w3-backends", default="tensorflow",
                   help="Keras backends of W3 (keras_scaling.py --backends)")
    p.add_argument("--w3-models", default=None,
                   help="W3's models (keras_scaling.py --models; default: "
                   "its own)")
    p.add_argument("--w3-shard", action="store_true",
                   help="W3 with the sharded optimizer's rows too "
                   "(keras_scaling.py --shard)")
    p.add_argument("--old-env", action="append", default=[],
                   metavar="NAME=VALUE",
                   help="a variable set for the old side's runs (repeatable)")
    p.add_argument("--new-env", action="append", default=[],
                   metavar="NAME=VALUE",
                   help="a variable set for the new side's runs (repeatable)")
    args = p.parse_args()
    trees = [os.path.abspath(args.old), os.path.abspath(args.new)]
    envs = [dict(kv.split("=", 1) for kv in args.old_env),
            dict(kv.split("=", 1) for kv in args.new_env)]
    results = [collections.defaultdict(list), collections.defaultdict(list)]
    skip = set(filter(None, args.skip.split(",")))
    for r in range(args.rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            s = skip | ({"w3"} if r >= args.w3_rounds else set())
            print(f"# round {r + 1}/{args.rounds}: {trees[side]} {envs[side]}",
                  flush=True)
            one_round(trees[side], s, results[side], envs[side],
                      args.w3_backends,
                      (["--shard"] if args.w3_shard else [])
                      + (["--models", args.w3_models] if args.w3_models
                         else []))
    names = [f"{t} {e}" if e else t for t, e in zip(trees, envs)]
    summary(results, *names)


if __name__ == "__main__":
    main()
