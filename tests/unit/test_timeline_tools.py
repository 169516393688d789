"""`kerasdist timeline summarize|plot` on hand-made traces (exact numbers)."""

import json
import os

import pytest

from kerasdist.tools import cli
from kerasdist.tools import timeline as timeline_tools


def _x(name, tid, ts, dur, **args):
    return {"ph": "X", "name": name, "pid": 0, "tid": tid, "ts": ts,
            "dur": dur, "args": args}


def _neg(tid, ts, waits):
    first = min(range(len(waits)), key=lambda r: waits[r])
    last = max(range(len(waits)), key=lambda r: waits[r])
    return _x("NEGOTIATE", tid, ts, max(waits), first_rank=first,
              last_rank=last, wait_us=waits)


def _step(t0, waits_a, waits_b):
    """Two tensors fused into one 8 KiB allreduce, 3 ranks."""
    na, nb = max(waits_a), max(waits_b)
    ready = t0 + max(na, 10 + nb)
    ev = [_neg(1, t0, waits_a), _neg(2, t0 + 10, waits_b),
          _x("QUEUE", 1, t0 + na, ready - (t0 + na)),
          _x("QUEUE", 2, t0 + 10 + nb, ready - (t0 + 10 + nb))]
    for tid in (1, 2):
        ev += [_x("MEMCPY_IN_FUSION_BUFFER", tid, ready, 5),
               _x("ALLREDUCE", tid, ready + 5, 40, bytes=4096, fused=2,
                  dtype="float32"),
               _x("MEMCPY_OUT_FUSION_BUFFER", tid, ready + 45, 5)]
    return ev


def _trace():
    ev = [{"ph": "M", "name": "process_name", "pid": 0,
           "args": {"name": "kerasdist rank 0"}},
          {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1,
           "args": {"name": "grad/a"}},
          {"ph": "M", "name": "thread_name", "pid": 0, "tid": 2,
           "args": {"name": "grad/b"}}]
    ev += _step(0, [0, 40, 100], [50, 0, 20])
    ev.append({"ph": "i", "s": "g", "name": "CYCLE", "pid": 0, "tid": 0,
               "ts": 500})
    ev += _step(1000, [0, 100, 300], [0, 10, 5])
    return ev


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace(), indent=0))
    return str(path)


def test_summarize_exact_numbers(trace_file):
    s = timeline_tools.summarize(trace_file)
    assert not s["truncated"]
    assert s["events"] == 20 and s["cycles"] == 1
    assert s["phases"]["NEGOTIATE"] == {"count": 4, "total_us": 460.0,
                                        "mean_us": 115.0}
    # Two fused batches of 4 KiB, each drawn on both rows.
    assert s["phases"]["ALLREDUCE"] == {"count": 4, "total_us": 160.0,
                                        "mean_us": 40.0, "batches": 2,
                                        "bytes": 8192}
    a = s["tensors"]["grad/a"]
    assert a["count"] == 2 and a["fused"] == 2.0
    assert a["NEGOTIATE"] == 400.0 and a["QUEUE"] == 0.0
    b = s["tensors"]["grad/b"]
    # grad/b waits in the queue for grad/a: step 1 (100 - 60), step 2
    # (300 - 20).
    assert b["QUEUE"] == 40.0 + 280.0
    # Step 2 starts at 1000; its last event ends at 1000+300+50 = 1350.
    assert s["span_us"] == 1350.0
    assert [(w["tensor"], w["dur_us"], w["last_rank"])
            for w in s["top_waits"][:3]] == [("grad/a", 300, 2),
                                             ("grad/a", 100, 2),
                                             ("grad/b", 50, 0)]


def test_straggler_table(trace_file):
    s = timeline_tools.summarize(trace_file)
    # rank 2 is last twice: others waited (100-0)+(100-40) + (300-0)+(300-100)
    assert s["stragglers"] == {
        0: {"last": 1, "waited_us": 80.0},
        1: {"last": 1, "waited_us": 15.0},
        2: {"last": 2, "waited_us": 660.0},
    }
    text = timeline_tools.format_summary(s)
    assert "# stragglers" in text
    line = [l for l in text.splitlines() if l.split()[:2] == ["2", "2"]]
    assert line and line[0].split()[2] == "0.660"


def test_single_rank_negotiations_make_no_stragglers(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps([_neg(1, 0, [0]), _neg(1, 10, [0])]))
    s = timeline_tools.summarize(str(path))
    assert s["stragglers"] == {} and s["phases"]["NEGOTIATE"]["count"] == 2


def test_truncated_file_recovers_events_before_the_cut(tmp_path):
    events = _trace()
    text = "[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n"
    # Cut in the middle of the 12th event (index 11): 11 whole events stay,
    # 3 of them metadata.
    cut = text.index(json.dumps(events[11])) + 17
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    trace = timeline_tools.load(str(path))
    assert trace.truncated
    assert len(trace.events) == 8
    assert trace.names == {1: "grad/a", 2: "grad/b"}
    # A cut right before an event (after its comma): the 5 whole events
    # before it stay, 2 of them complete events.
    path.write_text(text[:text.index(json.dumps(events[5]))])
    assert len(timeline_tools.load(str(path)).events) == 2
    # A file missing only its closing "]" keeps every event.
    path.write_text(text[:text.rindex("]")])
    t = timeline_tools.load(str(path))
    assert t.truncated and len(t.events) == 20 and len(t.cycles) == 1


def test_not_a_timeline(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"x": 1')
    with pytest.raises(ValueError, match="no '\\['"):
        timeline_tools.load(str(path))
    path.write_text("3")
    with pytest.raises(ValueError, match="JSON array"):
        timeline_tools.load(str(path))


def test_cli_summarize(trace_file, capsys):
    assert cli.main(["timeline", "summarize", trace_file]) == 0
    out = capsys.readouterr().out
    assert "# per phase" in out and "grad/a" in out
    assert cli.main(["timeline", "summarize", "--json", trace_file]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["stragglers"]["2"]["last"] == 2
    assert cli.main(["timeline", "summarize", trace_file + ".missing"]) == 1


def test_step_window(trace_file):
    trace = timeline_tools.load(trace_file)
    assert timeline_tools._step_window(trace, 1, 0) == (0, 1000)
    assert timeline_tools._step_window(trace, 1, 1) == (1000, 1350)


def test_plot_writes_png(trace_file, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "g.png"
    n = timeline_tools.plot(trace_file, str(out))
    assert n == 20
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out2 = tmp_path / "g1.png"
    assert cli.main(["timeline", "plot", trace_file, "-o", str(out2),
                     "--steps", "1"]) == 0
    assert os.path.getsize(out2) > 1000
    # Only step 1's events (ts < 1000) are drawn.
    assert timeline_tools.plot(trace_file, str(out2), steps=1) == 10
