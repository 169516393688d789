"""Named checks in a worker script: one pytest test per check, one launch.

In the worker (a rank script under tests/workers)::

    from tests.support import checks

    checks.group("equiv")            # the group of the checks below

    @checks.check("fit_adam")
    def fit_adam():
        ...                          # raises on failure

    @checks.check("op_sum_eager", function=False)
    @checks.check("op_sum_function", function=True)
    def op_sum(function):            # one function, two checks
        ...

    if __name__ == "__main__":
        checks.main(rank=kd.rank())

`worker.py --only a,b` runs those checks, `--group g` the checks of group
g, no option the checks of every group marked default; always in the order
they are written in the file (every rank runs the same checks in the same
order, so their collectives match). `--list` prints the names.
`--results DIR` makes each rank write DIR/rank<r>.json after every check:
which passed, and the traceback of the one that failed. A failed check ends
the rank (its peers may be waiting in a collective it will not join), so the
launcher ends the job; the checks after it are not run. Each passed check
also prints `OK <name>` and a finished run `DONE`, for the job's log.

The test side (tests/support/worker_checks.py) reads the names and groups
with `check_names`, from the worker's source, without running it: names are
string literals in `check(...)` decorators and `group(...)` statements at
the worker's top level.

Standard library only; never imports TensorFlow.
"""

import argparse
import ast
import json
import os
import re
import sys
import time
import traceback

_NAME_RE = re.compile(r"^[A-Za-z0-9_]+$")


class _Check:
    def __init__(self, name, groups, kwargs):
        self.name, self.groups, self.kwargs = name, groups, kwargs
        self.fn = None


_checks = []
_group = {"names": ("default",), "default": True}
_default_groups = set()


def group(*names, default=True):
    """The checks registered after this call belong to groups `names`;
    `default`: they run when the worker is given no --only or --group."""
    if not names or not all(_NAME_RE.match(n) for n in names):
        raise ValueError(f"group names must be [A-Za-z0-9_]+, got {names}")
    _group.update(names=tuple(names), default=default)


def check(name, *, groups=None, **kwargs):
    """Registers the decorated function as check `name`, called with
    `kwargs`; `groups` (a tuple of names) overrides the current group's."""
    if not _NAME_RE.match(name):
        raise ValueError(f"check name {name!r}: use letters, digits and _")
    if any(c.name == name for c in _checks):
        raise ValueError(f"check {name!r} is registered twice")
    entry = _Check(name, tuple(groups) if groups else _group["names"],
                   kwargs)
    if _group["default"]:
        _default_groups.update(entry.groups)
    # Registered now, when the decorator line runs (top to bottom), not when
    # it is applied (bottom to top): the run order is the source order.
    _checks.append(entry)

    def register(fn):
        entry.fn = fn
        return fn
    return register


def registered():
    """The registered checks' names, in run order."""
    return [c.name for c in _checks]


def _select(only, groups):
    names = registered()
    if only:
        wanted = [n for n in only.split(",") if n]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            sys.exit(f"unknown check(s) {unknown}; this worker has {names}")
        return [c for c in _checks if c.name in wanted]
    if groups:
        wanted = set(groups.split(","))
        known = {g for c in _checks for g in c.groups}
        if wanted - known:
            sys.exit(f"unknown group(s) {sorted(wanted - known)}; this worker "
                     f"has {sorted(known)}")
        return [c for c in _checks if wanted & set(c.groups)]
    return [c for c in _checks if _default_groups & set(c.groups)]


def _write(path, record):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def main(rank=0, argv=None):
    """Runs the selected checks (see the module docstring); `rank` names
    the result file. Arguments it does not know are left to the worker."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--group", default="")
    parser.add_argument("--results", default="")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    missing = [c.name for c in _checks if c.fn is None]
    if missing:
        sys.exit(f"check(s) {missing} were declared but not applied to a "
                 "function")
    if args.list:
        for c in _checks:
            print(c.name, ",".join(c.groups))
        return
    selected = _select(args.only, args.group)
    record = {"rank": rank, "selected": [c.name for c in selected],
              "results": {}, "done": False}
    path = (os.path.join(args.results, f"rank{rank}.json")
            if args.results else None)
    if path:
        _write(path, record)
    for c in selected:
        start = time.monotonic()
        try:
            c.fn(**c.kwargs)
        except BaseException:
            error = traceback.format_exc()
            record["results"][c.name] = {
                "passed": False, "error": error,
                "seconds": round(time.monotonic() - start, 3)}
            if path:
                _write(path, record)
            print(f"FAIL {c.name}", flush=True)
            raise
        record["results"][c.name] = {
            "passed": True, "seconds": round(time.monotonic() - start, 3)}
        if path:
            _write(path, record)
        print(f"OK {c.name}", flush=True)
    record["done"] = True
    if path:
        _write(path, record)
    print("DONE", flush=True)


# ---- reading a worker's checks from its source -------------------------------


def _is_call_to(node, name):
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == name))


def _strings(node, where):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(v for n in node.elts for v in _strings(n, where))
    raise ValueError(f"{where}: names must be string literals")


def check_names(path, groups=None):
    """[(name, groups)] of the checks in worker `path`, in run order, read
    from its source; with `groups`, only the checks in one of them."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    current, found = ("default",), []
    for node in tree.body:
        if isinstance(node, ast.Expr) and _is_call_to(node.value, "group"):
            where = f"{path}:{node.lineno}"
            current = tuple(v for a in node.value.args
                            for v in _strings(a, where))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            for dec in node.decorator_list:
                if not _is_call_to(dec, "check"):
                    continue
                where = f"{path}:{dec.lineno}"
                if not dec.args:
                    raise ValueError(f"{where}: check() needs a name")
                name = _strings(dec.args[0], where)[0]
                mine = current
                for kw in dec.keywords:
                    if kw.arg == "groups":
                        mine = _strings(kw.value, where)
                found.append((name, mine))
    if groups is not None:
        found = [(n, g) for n, g in found if set(g) & set(groups)]
    return found
