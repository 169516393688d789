"""Hosts and slots of a Slurm allocation, from the variables Slurm sets.

    SLURM_JOB_NODELIST=node[01-03,07],gpu-a1   SLURM_TASKS_PER_NODE=2(x3),1,4

gives [("node01", 2), ("node02", 2), ("node03", 2), ("node07", 1),
("gpu-a1", 4)]. Pure functions, standard library only; malformed text raises
ValueError naming the variable and what was expected.
"""

import re

from kerasdist.run import hosts as hosts_lib

NODELIST = "SLURM_JOB_NODELIST"
TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
JOB_ID = "SLURM_JOB_ID"

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top(text):
    """Splits at commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _too_many(count):
    """A ValueError when `count` hosts or tasks are more than a job has."""
    if count > hosts_lib.MAX_RANKS:
        raise ValueError(f"lists more than {hosts_lib.MAX_RANKS} entries, "
                         f"the most ranks of a kerasdist job")


def _expand_ranges(body):
    """"01-03,7" -> ["01", "02", "03", "7"] (zero padding kept)."""
    out = []
    for item in body.split(","):
        m = _RANGE_RE.match(item)
        if not m or len(item) > 25:
            raise ValueError(f"expected N or N-M in brackets, got {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards")
        _too_many(len(out) + int(hi) - int(lo) + 1)
        width = len(lo) if lo.startswith("0") else 0
        out += [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(pattern):
    """"rack[1-2]-n[01-02]" -> rack1-n01, rack1-n02, rack2-n01, rack2-n02."""
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    rests = _expand_one(tail) if tail else [""]
    values = _expand_ranges(m.group(1))
    _too_many(len(values) * len(rests))
    return [head + value + rest for value in values for rest in rests]


def expand_nodelist(text):
    """Expands a Slurm host list such as "node[01-04,07],gpu-a1".

    Returns:
        The host names, in Slurm's order.

    Raises:
        ValueError: the text is not a host list.
    """
    try:
        hosts = []
        for part in _split_top(text.strip()):
            if not part:
                raise ValueError("empty host entry")
            hosts += _expand_one(part)
            _too_many(len(hosts))
    except ValueError as e:
        raise ValueError(f"{NODELIST}={text!r}: {e}") from None
    return hosts


def expand_tasks_per_node(text):
    """Expands "2(x3),1" into [2, 2, 2, 1].

    Raises:
        ValueError: the text is not in that form.
    """
    counts = []
    for item in text.strip().split(","):
        m = _TASKS_RE.match(item)
        if not m or len(item) > 25:
            raise ValueError(f"{TASKS_PER_NODE}={text!r}: expected N or "
                             f"N(xR) items, got {item!r}")
        repeat = int(m.group(2) or 1)
        if len(counts) + repeat > hosts_lib.MAX_RANKS:
            raise ValueError(f"{TASKS_PER_NODE}={text!r} gives more than "
                             f"{hosts_lib.MAX_RANKS} nodes, the most ranks "
                             f"of a kerasdist job")
        counts += [hosts_lib.check_per_host(
            int(m.group(1)), f"{TASKS_PER_NODE}={text!r}")] * repeat
    return counts


def allocation(environ):
    """The [(host, slots), ...] of the Slurm allocation this runs in.

    Returns:
        The list, or None outside an allocation (no SLURM_JOB_ID or no
        SLURM_JOB_NODELIST).

    Raises:
        ValueError: the variables are malformed or do not agree.
    """
    if not environ.get(JOB_ID) or not environ.get(NODELIST):
        return None
    hosts = expand_nodelist(environ[NODELIST])
    tasks = environ.get(TASKS_PER_NODE)
    counts = expand_tasks_per_node(tasks) if tasks else [1] * len(hosts)
    if len(counts) != len(hosts):
        raise ValueError(
            f"{TASKS_PER_NODE}={tasks!r} gives {len(counts)} node(s) but "
            f"{NODELIST}={environ[NODELIST]!r} lists {len(hosts)}")
    return list(zip(hosts, counts))
