"""How a rank's output is cut into the pieces the launcher writes whole
(kerasdist/run/_rank.py Units) and how the launcher writes them to a
terminal (kerasdist/run/job.py Log)."""

import io

from kerasdist.run import _rank
from kerasdist.run import job


def _feed_all(chunks):
    units, out = _rank.Units(), []
    for chunk in chunks:
        out.append(units.feed(chunk))
    return out, units.close()


def test_keras_progress_bar_redraws_pass_on_live():
    # What Keras' Progbar writes: backspaces over the last text, "\r", the
    # new text; the final update ends with "\n".
    out, rest = _feed_all([b"Epoch 1/2\n", b"\r1/4 bar",
                           b"\b" * 7 + b"\r2/4 bar",
                           b"\b" * 7 + b"\r4/4 bar - loss\n"])
    assert out == [[b"Epoch 1/2\n"], [b"1/4 bar\r"], [b"2/4 bar\r"],
                   [b"4/4 bar - loss\r", b"\n"]]
    assert rest == []


def test_redraw_split_across_reads_is_shown_whole_each_time():
    out, _ = _feed_all([b"\r3/4 b", b"ar"])
    assert out == [[b"3/4 b\r"], [b"3/4 bar\r"]]


def test_line_written_in_pieces_waits_for_its_end():
    out, rest = _feed_all([b"part a ", b"part b", b"\nnext"])
    assert out == [[], [], [b"part a part b\n"]]
    assert rest == [b"next\n"]


def test_stream_ending_inside_a_redrawn_line_ends_it():
    out, rest = _feed_all([b"\r1/4 bar"])
    assert out == [[b"1/4 bar\r"]]
    assert rest == [b"\n"]


def test_carriage_return_line_feed_ends_a_line_once():
    out, _ = _feed_all([b"x\r\n", b"y\n"])
    assert out == [[b"x\r", b"\n"], [b"y\n"]]


def test_blank_lines_keep_the_rank_prefix_a_bars_end_does_not():
    units, state, out = _rank.Units(), {}, []
    for chunk in [b"a\n\n", b"\r1/2 bar", b"\r2/2 bar\n", b"\n", b"x\r\n"]:
        out += _rank.prefixed(units.feed(chunk), b"[1]<stdout>:", state)
    assert out == [b"[1]<stdout>:a\n", b"[1]<stdout>:\n",
                   b"[1]<stdout>:1/2 bar\r", b"[1]<stdout>:2/2 bar\r", b"\n",
                   b"[1]<stdout>:\n", b"[1]<stdout>:x\r", b"\n"]


def _log():
    out = io.BytesIO()
    return job.Log(out=out, err=out), out


def test_log_redraws_in_place_and_ends_the_bar_with_its_own_line():
    log, out = _log()
    for piece in (b"[0]<stdout>:1/4\r", b"[0]<stdout>:2/4\r",
                  b"[0]<stdout>:4/4 loss\r", b"\n"):
        log.raw(piece, log.out)
    assert out.getvalue() == (b"[0]<stdout>:1/4\r[0]<stdout>:2/4\r"
                              b"[0]<stdout>:4/4 loss\r\n")


def test_log_ends_an_open_bar_before_another_ranks_line():
    log, out = _log()
    for piece in (b"[0]<stdout>:1/4\r", b"[1]<stdout>:hello\n",
                  b"[0]<stdout>:2/4\r", b"\n"):
        log.raw(piece, log.out)
    assert out.getvalue() == (b"[0]<stdout>:1/4\r\n[1]<stdout>:hello\n"
                              b"[0]<stdout>:2/4\r\n")


def test_log_without_prefixes_keeps_other_lines_off_the_bar():
    log, out = _log()
    for piece in (b"1/4\r", b"hello\n", b"2/4\r", b"\n"):
        log.raw(piece, log.out)
    assert out.getvalue() == b"1/4\r\nhello\n2/4\r\n"


def test_launcher_message_ends_an_open_bar_first():
    log, out = _log()
    log.raw(b"[0]<stdout>:1/4\r", log.out)
    log.line("rank 1 exited with code 3")
    log.end_line()
    assert out.getvalue() == (b"[0]<stdout>:1/4\r\n"
                              b"kerasdist: rank 1 exited with code 3\n")
