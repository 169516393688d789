"""The records of trainer_fault_worker.py's jobs (one line per step and
rank: optimizer step, learning rate, example ids) read back, for the tests
that hold an interrupted job to an uninterrupted one (tests/parallel/
test_trainer_faults.py, tests/cluster/test_faults.py)."""

import collections
import re

from tests.support.helpers import rank_lines

N = 240  # examples, as in the worker
RESUMED = re.compile(
    r"resuming from \S+ at epoch (\d+) of \d+(?:, after its first (\d+) "
    r"examples)?.*\(optimizer step (\d+)\)")


def loss(out):
    return float(re.search(r"LOSS (\S+)", "\n".join(
        rank_lines(out.stdout, 0))).group(1))


def steps(logs, tag, attempt, np_):
    """{rank: [(step, lr, ids), ...]} of one attempt's records."""
    out = {}
    for r in range(np_):
        rows = []
        with open(logs / f"ids.{tag}.a{attempt}.r{r}.txt") as f:
            for line in f:
                step, lr, *ids = line.split()
                rows.append((int(step), float(lr), [int(i) for i in ids]))
        out[r] = rows
    return out


def resumed(out):
    """(epoch index, examples done in it, optimizer step) of the resume."""
    for line in rank_lines(out.stdout, 0):
        m = RESUMED.search(line)
        if m:
            return int(m.group(1)) - 1, int(m.group(2) or 0), int(m.group(3))
    raise AssertionError("no resume in:\n" + out.stdout[-4000:])


def epochs(steps):
    """Splits a job's steps (lists of the ids every rank trained in each
    step, in order) into epochs of N examples; returns their id lists."""
    epochs, current = [], []
    for ids in steps:
        current += ids
        if len(current) >= N:
            epochs.append(current)
            current = []
    assert not current, f"{len(current)} examples after the last epoch"
    return epochs


def job_steps(records, until=None):
    """The ids of every step of a job (all ranks together), in step
    order, from {rank: rows}; steps after `until` are left out."""
    by_step = collections.defaultdict(list)
    for rows in records.values():
        for step, _, ids in rows:
            if until is None or step <= until:
                by_step[step] += ids
    return [by_step[s] for s in sorted(by_step)]
