"""Keras' progress bar through `kerasdist run`, read through a terminal.

The launcher runs on a pseudo-terminal, as in an interactive shell; the
bytes it writes are replayed through a small terminal model (carriage
return, line feed, overwrite) to get the lines a person sees.
"""

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from tests.support.helpers import REPO_ROOT
from tests.support.helpers import WORKERS
from tests.support.helpers import kill_tree
from tests.support.helpers import launcher_env

pytestmark = pytest.mark.parallel

_ESCAPES = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")
_PREFIX = re.compile(r"\[\d+\]<std(?:out|err)>:")
_BAR = re.compile(r"(\d+)/(\d+) ━+")
# A line of absl's log (TensorFlow's C++ start-up messages), prefix and all,
# with nothing of a progress bar in it.
_ABSL_LOG = re.compile(r"^(\[\d+\]<stderr>:)?[IWEF]\d{4} [\d:.]+ +\d+ "
                       r"[\w.]+:\d+\] [^━]*$")


def _run_on_terminal(launcher_args=(), env_extra=None, timeout=240):
    """[(time received, bytes)] that the launcher wrote to its terminal."""
    env = launcher_env(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                            **(env_extra or {})))
    master, slave = pty.openpty()
    argv = [sys.executable, "-m", "kerasdist.run", *launcher_args, "-np",
            "2", sys.executable, os.path.join(WORKERS,
                                              "progress_bar_worker.py")]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=env, cwd=REPO_ROOT,
                            start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not data:
                break
            chunks.append((time.monotonic(), data))
        else:
            pytest.fail(f"the launcher ran past {timeout} s")
        assert proc.wait(timeout=30) == 0, _screen(chunks)
    finally:
        kill_tree(proc)
        os.close(master)
    return chunks


def _screen(chunks):
    """The lines a terminal shows after those bytes (colours dropped)."""
    data = _ESCAPES.sub(b"", b"".join(d for _, d in chunks))
    lines, line, col = [], [], 0
    for ch in data.decode("utf-8", "replace"):
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    if line:
        lines.append("".join(line).rstrip())
    return lines


def _first_time(chunks, pattern):
    """When the terminal first received bytes matching `pattern`."""
    seen = b""
    for t, data in chunks:
        seen += data
        if re.search(pattern, _ESCAPES.sub(b"", seen)):
            return t
    raise AssertionError(f"{pattern!r} never arrived")


def _check_rank_one_lines(lines, prefix):
    talk = [ln for ln in lines if "rank one line" in ln]
    expected = [f"{prefix}rank one line {b} done"
                for _ in range(2) for b in range(0, 16, 3)]
    assert talk == expected, "\n".join(lines)


def test_progress_bar_is_live_and_whole_with_rank_prefixes():
    chunks = _run_on_terminal()
    lines = _screen(chunks)
    text = "\n".join(lines)
    # Every line a person sees has one rank prefix, at its start.
    for ln in lines:
        if ln.startswith("["):
            assert len(_PREFIX.findall(ln)) == 1, text
            assert _PREFIX.match(ln), text
    # No two lines glued into one: none is long, but for the framework's
    # own start-up log lines (absl's format; TensorFlow's oneDNN notice is
    # 240 characters on CPUs where oneDNN's custom operations are on).
    assert max(len(ln) for ln in lines
               if not _ABSL_LOG.match(ln)) < 200, text
    _check_rank_one_lines(lines, "[1]<stdout>:")
    # Each epoch's bar ends on its own line, complete, with the loss (a
    # snapshot of it stays above a line another rank wrote in between).
    epochs = text.split("[0]<stdout>:Epoch ")[1:]
    assert len(epochs) == 2, text
    for epoch in epochs:
        bars = [ln for ln in epoch.splitlines() if _BAR.search(ln)]
        assert bars and bars[-1].startswith("[0]<stdout>:"), text
        assert re.search(r"16/16 ━+ .*loss: [0-9.]+$", bars[-1]), text
    # Live: the bar's first redraw arrived long before the epoch ended
    # (16 steps of 0.1 s), not with the epoch's last line.
    first = _first_time(chunks, rb"\[0\]<stdout>: ?1/16 ")
    last = _first_time(chunks, rb"16/16 \S+ .*loss[^\r\n]*\r")
    assert last - first > 0.8, (first, last)
    # Redraws are carriage returns, not new lines: bar snapshots stay only
    # where another rank's line came between two redraws.
    bar_lines = [ln for ln in lines if _BAR.search(ln)]
    assert len(bar_lines) <= 2 + 2 * 6, text


def test_lines_stay_whole_without_prefix_and_unbuffered():
    chunks = _run_on_terminal(("--no-prefix",), {"PYTHONUNBUFFERED": "1"})
    lines = _screen(chunks)
    _check_rank_one_lines(lines, "")
    text = "\n".join(lines)
    assert "finished on rank 0" in lines and "finished on rank 1" in lines, \
        text
    assert [ln for ln in lines if re.search(r"16/16 ━+.*loss", ln)], text
