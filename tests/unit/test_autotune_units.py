"""The autotuner's decisions from given window scores.

The runtime's knobs are replaced by a record of what the tuner set, and each
window returns the next of a scripted list of scores: what is under test is
which setting the tuner keeps, not the runtime (tests/parallel covers the
tuner on real ranks).
"""

import pytest

pytest.importorskip("sklearn")

from kerasdist import autotune  # noqa: E402

START = (67108864, 0.0, True)


def _run(monkeypatch, scores, max_samples=3, confirm_rounds=2):
    applied = []
    monkeypatch.setattr(autotune, "get_tunables", lambda: START)
    monkeypatch.setattr(autotune, "set_tunables",
                        lambda *s: applied.append(tuple(s)))
    tuner = autotune.Autotuner(warmup_samples=1, max_samples=max_samples,
                               seed=3, confirm_rounds=confirm_rounds)
    it = iter(scores)
    monkeypatch.setattr(tuner, "_window", lambda: next(it, None))
    tuner._run()
    return tuner, applied


def test_noisy_best_loses_the_confirmation_and_the_start_stays(monkeypatch):
    # warm-up; samples: start 10, a lucky 12, 5; confirmation: start 10 and
    # 11, the lucky one 9 and 9.
    tuner, applied = _run(monkeypatch, [1, 10, 12, 5, 10, 9, 11, 9])
    lucky = applied[1]
    assert lucky != START
    assert applied[3:7] == [START, lucky, START, lucky]
    assert tuner.confirmed is False
    assert tuner.best == START and tuner.best_score == 10.5
    assert applied[-1] == START


def test_real_gain_survives_the_confirmation(monkeypatch):
    tuner, applied = _run(monkeypatch, [1, 10, 12, 5, 10, 13, 10, 14])
    better = applied[1]
    assert tuner.confirmed is True
    assert tuner.best == better and tuner.best_score == 13.5
    assert applied[-1] == better


def test_a_gain_within_the_margin_keeps_the_start(monkeypatch):
    # The best sample's confirmation median 10.15 against 10.0: +1.5%,
    # under the 2% a change of setting must earn.
    tuner, applied = _run(monkeypatch, [1, 10, 12, 5, 10, 10.1, 10, 10.2])
    assert tuner.confirmed is False and tuner.best == START
    assert applied[-1] == START


def test_start_best_or_no_rounds_means_no_confirmation(monkeypatch):
    tuner, applied = _run(monkeypatch, [1, 10, 8, 5])
    assert tuner.confirmed is None and tuner.best == START
    assert len(applied) == 4 and applied[-1] == START
    tuner, applied = _run(monkeypatch, [1, 10, 12, 5], confirm_rounds=0)
    assert tuner.confirmed is None and tuner.best == applied[1] != START


def test_stopped_during_confirmation_keeps_the_best_sample(monkeypatch):
    tuner, applied = _run(monkeypatch, [1, 10, 12, 5, 10])
    assert tuner.confirmed is None
    assert tuner.best == applied[1] and tuner.best_score == 12
    assert applied[-1] == applied[1]
