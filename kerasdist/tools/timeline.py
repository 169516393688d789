"""`kerasdist timeline summarize|plot FILE`: read a kerasdist timeline.

A timeline is a Chrome trace (JSON Array Format) written by rank 0 of a job
run with `KERASDIST_TIMELINE=path` or `kerasdist.start_timeline(path)`. It
holds one row per tensor; each row has complete ("X") events for the phases a
tensor goes through: NEGOTIATE (from the first rank's readiness report to the
last's), QUEUE, MEMCPY_IN_FUSION_BUFFER, the collective (ALLREDUCE, ...) and
MEMCPY_OUT_FUSION_BUFFER. Open it in chrome://tracing or https://ui.perfetto.dev
to browse it; this module answers the usual questions from a terminal:

    kerasdist timeline summarize trace.json          # totals, waits, stragglers
    kerasdist timeline plot trace.json -o gantt.png --steps 3

A file cut short (a killed job) is read up to the last complete event.
Standard library only, except `plot`, which needs matplotlib; the event
names come from kerasdist's core library, which writes them.
"""

import argparse
import collections
import json
import sys

from kerasdist._core import capi as _capi


def _names(*roles):
    """Event names of the given roles (ops/core/timeline.h: negotiate,
    queue, copy_in, collective, host_in, host_out, copy_out, marker), in the
    order a tensor meets the phases."""
    return tuple(name for name, role in _capi.timeline_phases().items()
                 if role in roles)


def phase_names():
    """Every phase name, in the order a tensor goes through them."""
    return _names("negotiate", "queue", "copy_in", "collective", "host_in",
                  "host_out", "copy_out")


def collective_names():
    """The collectives' phase names (ALLREDUCE, ...)."""
    return _names("collective")


def _negotiate():
    return _names("negotiate")[0]


def _cycle():
    return _names("marker")[0]


class Trace:
    """The parsed content of a timeline file.

    Attributes:
        events: the complete ("X") events, in file order.
        names: row id (`tid`) -> tensor name.
        cycles: timestamps (us) of the CYCLE markers.
        truncated: True if the file was cut short and only the events before
            the cut were recovered.
    """

    def __init__(self, events, names, cycles, truncated):
        self.events = events
        self.names = names
        self.cycles = cycles
        self.truncated = truncated

    def name(self, tid):
        return self.names.get(tid, f"tid {tid}")


def _decode_events(text):
    """Returns (list of event dicts, truncated?) from a trace's text.

    A complete file is a JSON array. A file cut by a killed job is an
    unterminated array whose last element may be partial: decode element by
    element and keep what parsed before the cut.
    """
    try:
        data = json.loads(text)
    except ValueError:
        pass
    else:
        if isinstance(data, dict):  # JSON Object Format: {"traceEvents": []}
            data = data.get("traceEvents", [])
        if not isinstance(data, list):
            raise ValueError("a timeline must be a JSON array of events, got "
                             f"{type(data).__name__}.")
        return data, False
    start = text.find("[")
    if start < 0:
        raise ValueError("not a timeline: no '[' opening the event array.")
    decoder = json.JSONDecoder()
    events, pos, n = [], start + 1, len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        try:
            event, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break  # the cut: a partial event
        events.append(event)
    return events, True


def load(path):
    """Reads a timeline file, recovering the events before a cut.

    Args:
        path: the trace file.

    Returns:
        A `Trace`.

    Raises:
        ValueError: the file is not a JSON array of trace events.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    raw, truncated = _decode_events(text)
    events, names, cycles = [], {}, []
    cycle = _cycle()
    for e in raw:
        if not isinstance(e, dict):
            continue
        ph = e.get("ph")
        if ph == "M" and e.get("name") == "thread_name":
            names[e.get("tid")] = str(e.get("args", {}).get("name", ""))
        elif ph == "X" and "ts" in e:
            e.setdefault("dur", 0)
            events.append(e)
        elif ph in ("i", "I") and e.get("name") == cycle:
            cycles.append(e.get("ts", 0))
    return Trace(events, names, cycles, truncated)


def _straggler_rows(negotiations):
    """Per rank: times it was the last ready, and the time others waited.

    The time others waited for the last rank L in one negotiation is the sum
    over the other ranks r of wait_us[L] - wait_us[r] (rank-microseconds:
    each rank that reported earlier sat idle until L reported). Without
    per-rank waits, the negotiation's duration stands in for it.
    """
    rows = collections.defaultdict(lambda: {"last": 0, "waited_us": 0.0})
    for e in negotiations:
        args = e.get("args") or {}
        waits = args.get("wait_us")
        if isinstance(waits, list) and len(waits) < 2:
            continue  # a single rank: nobody waits for anybody
        last = args.get("last_rank")
        if last is None:
            continue
        row = rows[int(last)]
        row["last"] += 1
        if isinstance(waits, list) and 0 <= last < len(waits):
            row["waited_us"] += sum(waits[last] - w for i, w in
                                    enumerate(waits) if i != last)
        else:
            row["waited_us"] += e.get("dur", 0)
    return dict(sorted(rows.items()))


def summarize(trace, top=10):
    """Computes the totals of a trace.

    Args:
        trace: a `Trace` (from `load`) or a path.
        top: how many of the longest negotiations to list.

    Returns:
        A dict: `phases` (phase -> {count, total_us, mean_us}, and for the
        collectives also `batches` and `bytes`: the distinct collective
        calls, a fused batch counted once, and the bytes they moved),
        `tensors` (name -> {phase -> total_us, "count": collectives,
        "fused": mean number of tensors in its batches}), `top_waits`
        (the `top` longest NEGOTIATE events: tensor, dur_us, ts,
        first_rank, last_rank), `stragglers` (rank -> {last,
        waited_us}), `span_us` (first event start to last event end),
        `cycles`, `events` and `truncated`.
    """
    if isinstance(trace, str):
        trace = load(trace)
    phases = collections.defaultdict(lambda: {"count": 0, "total_us": 0.0})
    tensors = collections.defaultdict(
        lambda: collections.defaultdict(float))
    negotiations = []
    batches = {}  # a fused batch appears on every row it holds: count once
    colls, negotiate = collective_names(), _negotiate()
    t0, t1 = None, None
    for e in trace.events:
        ph, dur, ts = e.get("name", "?"), e.get("dur", 0), e["ts"]
        t0 = ts if t0 is None else min(t0, ts)
        t1 = ts + dur if t1 is None else max(t1, ts + dur)
        phases[ph]["count"] += 1
        phases[ph]["total_us"] += dur
        row = tensors[trace.name(e.get("tid"))]
        row[ph] += dur
        if ph in colls:
            args = e.get("args") or {}
            row["count"] += 1
            row["fused"] += args.get("fused", 1)
            batches[(ph, ts, dur, args.get("bytes", 0))] = args.get(
                "bytes", 0)
        if ph == negotiate:
            negotiations.append(e)
    for p in phases.values():
        p["mean_us"] = p["total_us"] / p["count"] if p["count"] else 0.0
    for (ph, _, _, _), nbytes in batches.items():
        phases[ph]["batches"] = phases[ph].get("batches", 0) + 1
        phases[ph]["bytes"] = phases[ph].get("bytes", 0) + nbytes
    for row in tensors.values():
        if row.get("count"):
            row["fused"] /= row["count"]
    waits = sorted(negotiations, key=lambda e: -e.get("dur", 0))[:top]
    top_waits = [{"tensor": trace.name(e.get("tid")), "dur_us": e["dur"],
                  "ts": e["ts"],
                  "first_rank": (e.get("args") or {}).get("first_rank"),
                  "last_rank": (e.get("args") or {}).get("last_rank")}
                 for e in waits]
    ordered = {p: dict(phases[p]) for p in phase_names() if p in phases}
    ordered.update({p: dict(v) for p, v in phases.items() if p not in ordered})
    return {
        "phases": ordered,
        "tensors": {k: dict(v) for k, v in sorted(tensors.items())},
        "top_waits": top_waits,
        "stragglers": _straggler_rows(negotiations),
        "span_us": (t1 - t0) if t0 is not None else 0.0,
        "cycles": len(trace.cycles),
        "events": len(trace.events),
        "truncated": trace.truncated,
    }


def _ms(us):
    return f"{us / 1000.0:.3f}"


def format_summary(s, max_tensors=30):
    """Renders `summarize()`'s dict as text tables."""
    out = []
    note = " (truncated file: events before the cut)" if s["truncated"] else ""
    out.append(f"# {s['events']} events over {_ms(s['span_us'])} ms, "
               f"{s['cycles']} cycle markers{note}")
    out.append("")
    out.append("# per phase")
    out.append(f"{'phase':<26}{'count':>8}{'total(ms)':>12}{'mean(us)':>11}"
               f"{'batches':>9}{'bytes':>13}")
    for name, p in s["phases"].items():
        extra = (f"{p['batches']:>9}{p['bytes']:>13}" if "batches" in p
                 else "")
        out.append(f"{name:<26}{p['count']:>8}{_ms(p['total_us']):>12}"
                   f"{p['mean_us']:>11.1f}{extra}")
    out.append("")
    cols = [p for p in s["phases"]]
    # Column heads: the role for the bookkeeping phases, the collective's
    # name for the collectives.
    roles = _capi.timeline_phases()
    heads = [p.lower() if roles.get(p, "collective") == "collective"
             else roles[p] for p in cols]
    width = max([len("tensor")] + [len(t) for t in s["tensors"]])
    width = min(width, 48)
    out.append("# per tensor (ms; sorted by total, busiest first)")
    out.append(f"{'tensor':<{width}}{'n':>6}{'fused':>7}"
               + "".join(f"{h:>11}" for h in heads))
    rows = sorted(s["tensors"].items(),
                  key=lambda kv: -sum(kv[1].get(p, 0) for p in cols))
    for name, row in rows[:max_tensors]:
        label = name if len(name) <= width else "..." + name[-(width - 3):]
        out.append(f"{label:<{width}}{int(row.get('count', 0)):>6}"
                   f"{row.get('fused', 0):>7.1f}"
                   + "".join(f"{_ms(row.get(p, 0)):>11}" for p in cols))
    if len(rows) > max_tensors:
        out.append(f"# ... {len(rows) - max_tensors} more tensors")
    out.append("")
    out.append("# top waits (longest negotiations: ready on the first rank "
               "until ready on the last)")
    out.append(f"{'tensor':<{width}}{'wait(us)':>10}{'at(ms)':>11}"
               f"{'first':>7}{'last':>6}")
    for w in s["top_waits"]:
        name = w["tensor"]
        label = name if len(name) <= width else "..." + name[-(width - 3):]
        out.append(f"{label:<{width}}{w['dur_us']:>10.0f}{_ms(w['ts']):>11}"
                   f"{str(w['first_rank']):>7}{str(w['last_rank']):>6}")
    out.append("")
    out.append("# stragglers (per rank: negotiations it was the last to "
               "report in; time the other ranks spent waiting for it)")
    out.append(f"{'rank':>6}{'last':>8}{'others_waited(ms)':>20}")
    for r, row in s["stragglers"].items():
        out.append(f"{r:>6}{row['last']:>8}{_ms(row['waited_us']):>20}")
    return "\n".join(out) + "\n"


def _step_window(trace, steps, skip):
    """(t_start, t_end) in us covering `steps` steps after `skip` steps.

    A step is counted on the tensor row negotiated most often (the first
    of those to appear): a gradient is reduced once per step, so the k-th
    negotiation of its row starts step k, while a one-time start-up
    broadcast or a once-per-epoch metric average would count far fewer.
    """
    negs = [e for e in trace.events if e.get("name") == _negotiate()]
    if not negs:
        colls = collective_names()
        negs = [e for e in trace.events if e.get("name") in colls]
    if not negs:
        return None
    rows = {}
    for e in sorted(negs, key=lambda e: e["ts"]):
        rows.setdefault(e.get("tid"), []).append(e["ts"])
    starts = max(rows.values(), key=len)  # the first such row on a tie
    begin = starts[skip] if skip < len(starts) else starts[-1]
    end_i = skip + steps
    end = (starts[end_i] if end_i < len(starts)
           else max(e["ts"] + e["dur"] for e in trace.events))
    return begin, end


# Bar colour by the phase's role (ops/core/timeline.h).
_COLORS = {"negotiate": "#d9d9d9", "queue": "#fdb462", "copy_in": "#80b1d3",
           "copy_out": "#8dd3c7", "collective": "#e41a1c"}


def plot(trace, output, steps=None, skip=0, max_rows=60, title=None):
    """Draws a Gantt chart of a trace: one row per tensor, one colour per
    phase, cycle markers as thin vertical lines.

    Args:
        trace: a `Trace` or a path.
        output: the image file to write (PNG, SVG, PDF: by extension).
        steps: draw only this many steps (see `_step_window`); None: all.
        skip: steps to leave out at the start (e.g. warm-up).
        max_rows: at most this many tensor rows (the first to appear).
        title: the figure title (default: the event count and span).

    Returns:
        The number of events drawn.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("`kerasdist timeline plot` needs matplotlib: "
                          "`pip install matplotlib`.") from e
    if isinstance(trace, str):
        trace = load(trace)
    window = None
    if steps is not None or skip:
        window = _step_window(trace, steps if steps is not None else 10**9,
                              skip)
    events = trace.events
    if window is not None:
        lo, hi = window
        events = [e for e in events if e["ts"] + e["dur"] > lo and
                  e["ts"] < hi]
    first_seen = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        first_seen.setdefault(e.get("tid"), len(first_seen))
    tids = [t for t, i in sorted(first_seen.items(), key=lambda kv: kv[1])]
    tids = tids[:max_rows]
    row_of = {t: i for i, t in enumerate(tids)}
    bars = collections.defaultdict(lambda: collections.defaultdict(list))
    drawn = 0
    for e in events:
        row = row_of.get(e.get("tid"))
        if row is None:
            continue
        bars[e.get("name")][row].append((e["ts"] / 1000.0,
                                         max(e["dur"], 1) / 1000.0))
        drawn += 1
    height = max(2.5, 0.25 * len(tids) + 1.5)
    fig, ax = plt.subplots(figsize=(12, height))
    legend = []
    known = phase_names()
    roles = _capi.timeline_phases()
    for phase in list(known) + sorted(set(bars) - set(known)):
        if phase not in bars:
            continue
        color = _COLORS.get(roles.get(phase), "#bebada")
        for row, spans in bars[phase].items():
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color,
                           edgecolor="none")
        legend.append(Patch(color=color, label=phase))
    cycles = trace.cycles
    if window is not None:
        cycles = [c for c in cycles if window[0] <= c <= window[1]]
    for c in cycles[:2000]:
        ax.axvline(c / 1000.0, color="#999999", linewidth=0.3, zorder=0)
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([trace.name(t)[-40:] for t in tids], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since the timeline started (ms)")
    if window is not None:
        ax.set_xlim(window[0] / 1000.0, window[1] / 1000.0)
    ax.legend(handles=legend, loc="upper right", fontsize=7)
    ax.set_title(title or f"kerasdist timeline: {drawn} events, "
                 f"{len(tids)} tensors")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return drawn


def main(argv=None):
    """`kerasdist timeline summarize|plot FILE ...`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="kerasdist timeline",
        description="Summarize or plot a kerasdist timeline (Chrome trace).")
    sub = parser.add_subparsers(dest="command", required=True)
    p_sum = sub.add_parser("summarize", help="per-tensor and per-phase "
                           "totals, top waits, straggler table")
    p_sum.add_argument("file")
    p_sum.add_argument("--top", type=int, default=10,
                       help="how many of the longest waits to list")
    p_sum.add_argument("--json", action="store_true",
                       help="print the summary as JSON")
    p_plot = sub.add_parser("plot", help="Gantt chart of the tensor phases")
    p_plot.add_argument("file")
    p_plot.add_argument("-o", "--output", required=True,
                        help="image to write (.png, .svg, .pdf)")
    p_plot.add_argument("--steps", type=int, default=None,
                        help="draw only this many training steps")
    p_plot.add_argument("--skip", type=int, default=0,
                        help="steps to leave out at the start")
    args = parser.parse_args(argv)
    try:
        trace = load(args.file)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"kerasdist timeline: error: {args.file}: {e}\n")
        return 1
    if trace.truncated:
        sys.stderr.write(f"kerasdist timeline: {args.file} is cut short; "
                         f"read the {len(trace.events)} events before the "
                         "cut.\n")
    if args.command == "summarize":
        s = summarize(trace, top=args.top)
        if args.json:
            sys.stdout.write(json.dumps(s, indent=1, sort_keys=True) + "\n")
        else:
            sys.stdout.write(format_summary(s))
        return 0
    try:
        n = plot(trace, args.output, steps=args.steps, skip=args.skip)
    except ImportError as e:
        sys.stderr.write(f"kerasdist timeline: error: {e}\n")
        return 1
    sys.stdout.write(f"wrote {args.output} ({n} events)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
