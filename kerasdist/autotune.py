"""Tune the runtime's fusion threshold, cycle time and cache while training.

With `KERASDIST_AUTOTUNE=1` (launcher flag `--autotune`) or
`kerasdist.init(autotune=True)`, a daemon thread on rank 0 tries settings of
the three knobs the coordinator uses — the Tensor Fusion threshold, the
batching window (cycle time) and the response cache — while the job trains,
and scores each by the bytes allreduced per second over a sampling window.
Bayesian optimisation (a scikit-learn Gaussian process with expected
improvement) picks the next setting to try from the scores so far. The
first windows are warm-up (start-up and tracing make them unrepresentative)
and are discarded. One window per setting is noisy, and the highest of 20
noisy scores is too high by construction; so before settling, the best
setting and the starting one run in alternating windows (the confirmation)
and the best is kept only if its median beats the starting setting's by
more than 2%. The setting kept is applied and stays. Only rank 0 tunes:
every rank executes the coordinator's fusion plan, so rank 0's settings
change the whole job consistently, at the same step on every rank.

`KERASDIST_AUTOTUNE_LOG=file.csv` records every sample: time, threshold,
cycle_ms, cache, bytes_per_s, best_bytes_per_s, phase (`warmup`,
`sample`, `confirm`, `final`).

Example:
>>> kd.init()
>>> tuner = kd.autotune.start_autotune(log_path="tune.csv")  # rank 0
>>> model.fit(...)
>>> kd.autotune.stop_autotune()  # applies the best setting found so far
"""

import csv
import ctypes
import math
import statistics
import threading
import time
import warnings

from kerasdist._core import capi as _capi

_LOG_FIELDS = ("time", "threshold", "cycle_ms", "cache", "bytes_per_s",
               "best_bytes_per_s", "phase")
# The search space: log2 of the fusion threshold in bytes (64 KiB to
# 256 MiB), the cycle time in ms, the response cache on (1) or off (0).
_LOG2_THRESHOLD = (16.0, 28.0)
_CYCLE_MS = (0.0, 5.0)

_tuner = None
_tuner_lock = threading.Lock()


def stats():
    """The runtime's cumulative counters since init.

    Returns:
        (allreduced_bytes, collectives, busy_seconds).

    Raises:
        RuntimeError: kerasdist is not initialized.
    """
    b, c, s = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_double()
    if _capi.lib().kerasdist_stats(ctypes.byref(b), ctypes.byref(c),
                                   ctypes.byref(s)):
        raise RuntimeError(_capi.last_error())
    return b.value, c.value, s.value


def get_tunables():
    """This rank's (fusion_threshold_bytes, cycle_time_ms, cache_enabled)."""
    t, c, e = ctypes.c_int64(), ctypes.c_double(), ctypes.c_int()
    if _capi.lib().kerasdist_get_tunables(ctypes.byref(t), ctypes.byref(c),
                                          ctypes.byref(e)):
        raise RuntimeError(_capi.last_error())
    return t.value, c.value, bool(e.value)


def set_tunables(threshold, cycle_ms, cache):
    """Applies a setting on this rank (the coordinator's is the one used)."""
    if _capi.lib().kerasdist_set_tunables(int(threshold), float(cycle_ms),
                                          int(bool(cache))):
        raise RuntimeError(f"set_tunables({threshold}, {cycle_ms}, {cache}) "
                           f"failed: {_capi.last_error()}")


class _GaussianProcessSearch:
    """Ask/tell Bayesian optimisation over the unit cube, maximising.

    The surrogate is scikit-learn's GaussianProcessRegressor (Matern kernel
    plus a white-noise term, since throughput samples are noisy); the next
    point maximises expected improvement over random candidates. The first
    `n_initial` points are random (the GP needs data to say anything).
    """

    def __init__(self, dims, n_initial=4, n_candidates=2000, seed=0):
        import numpy as np
        from scipy.stats import norm
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import Matern
        from sklearn.gaussian_process.kernels import WhiteKernel

        self._np, self._norm = np, norm
        self._rng = np.random.default_rng(seed)
        self._dims = dims
        self._n_initial = n_initial
        self._n_candidates = n_candidates
        self._gp = GaussianProcessRegressor(
            kernel=Matern(length_scale=[0.3] * dims, nu=2.5)
            + WhiteKernel(noise_level=0.05,
                           noise_level_bounds=(1e-8, 10.0)),
            normalize_y=True, n_restarts_optimizer=2,
            random_state=seed)
        self.xs, self.ys = [], []

    def ask(self):
        np = self._np
        if len(self.xs) < self._n_initial:
            return self._rng.random(self._dims)
        with warnings.catch_warnings():
            # Few noisy samples often put a length scale at its bound;
            # the fit is still usable, and the warning would reach the user.
            warnings.simplefilter("ignore")
            self._gp.fit(np.array(self.xs), np.array(self.ys))
        cand = self._rng.random((self._n_candidates, self._dims))
        mu, sd = self._gp.predict(cand, return_std=True)
        best = max(self.ys)
        sd = np.maximum(sd, 1e-12)
        z = (mu - best) / sd
        ei = (mu - best) * self._norm.cdf(z) + sd * self._norm.pdf(z)
        return cand[int(np.argmax(ei))]

    def tell(self, x, y):
        self.xs.append(list(x))
        self.ys.append(float(y))


def _decode(u):
    """Unit-cube point -> (threshold bytes, cycle ms, cache).

    The cycle time goes as u**2, so half the range lies below a quarter of
    the largest value: short windows (usually the right choice when the
    runtime wakes on arrivals) get most of the search's attention.
    """
    lo, hi = _LOG2_THRESHOLD
    threshold = int(round(2.0 ** (lo + u[0] * (hi - lo))))
    cycle = _CYCLE_MS[0] + u[1] ** 2 * (_CYCLE_MS[1] - _CYCLE_MS[0])
    return threshold, round(cycle, 3), bool(u[2] >= 0.5)


def _encode(setting):
    """(threshold, cycle ms, cache) -> unit-cube point (clipped)."""
    threshold, cycle, cache = setting
    lo, hi = _LOG2_THRESHOLD
    u0 = (math.log2(max(threshold, 1)) - lo) / (hi - lo)
    u1 = math.sqrt(max(cycle - _CYCLE_MS[0], 0.0)
                   / (_CYCLE_MS[1] - _CYCLE_MS[0]))
    return [min(max(u0, 0.0), 1.0), min(u1, 1.0), 1.0 if cache else 0.0]


class Autotuner:
    """The tuning thread (create it with `start_autotune`).

    Attributes:
        best: the best (threshold, cycle_ms, cache) so far, or None.
        best_score: its bytes per second.
        samples: the number of scored (non-warm-up) samples.
        confirmed: after the confirmation, True if the best sampled setting
            beat the starting one there (and was kept), False if the
            starting setting was kept; None before or without one.
        done: a threading.Event set when the thread has ended, with the best
            setting applied.
    """

    def __init__(self, log_path=None, sample_seconds=2.0,
                 min_collectives=20, warmup_samples=3, max_samples=20,
                 seed=0, confirm_rounds=3, min_gain=0.02):
        self._search = _GaussianProcessSearch(3, seed=seed)
        self._log_path = log_path
        self._sample_seconds = sample_seconds
        self._min_collectives = min_collectives
        self._warmup = warmup_samples
        self._max_samples = max_samples
        self._confirm_rounds = confirm_rounds
        self._min_gain = min_gain
        self.confirmed = None
        self._stop = threading.Event()
        self.done = threading.Event()
        self.best, self.best_score, self.samples = None, -1.0, 0
        self.error = None
        self._t0 = time.monotonic()
        self._log_file = self._writer = None
        if log_path:
            self._log_file = open(log_path, "w", newline="")
            self._writer = csv.writer(self._log_file)
            self._writer.writerow(_LOG_FIELDS)
            self._log_file.flush()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kerasdist-autotune")

    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout=None):
        """Ends tuning early; the best setting so far stays applied."""
        self._stop.set()
        self._thread.join(timeout)
        return self.best

    def _log(self, setting, score, phase):
        if self._writer is None:
            return
        t, c, e = setting
        best = self.best_score if self.best_score >= 0 else ""
        self._writer.writerow([f"{time.monotonic() - self._t0:.3f}", t, c,
                               int(e), f"{score:.1f}",
                               best if best == "" else f"{best:.1f}", phase])
        self._log_file.flush()

    def _window(self):
        """Bytes/s over one window, or None if stopped or the job is idle.

        The window lasts at least `sample_seconds` and `min_collectives`
        collective batches, so a slow step does not make a sample of zero.
        """
        b0, c0, _ = stats()
        t0 = time.monotonic()
        while not self._stop.wait(min(0.05, self._sample_seconds)):
            b1, c1, _ = stats()
            elapsed = time.monotonic() - t0
            if (elapsed >= self._sample_seconds
                    and c1 - c0 >= self._min_collectives):
                return (b1 - b0) / elapsed
            if elapsed > 30 * max(self._sample_seconds, 1.0):
                return None  # the job stopped reducing: give up this one
        return None

    def _confirm(self, start):
        """Best against `start` in alternating windows; keeps the best only
        if its median is more than `min_gain` above the start's (a change
        of setting has to earn its place; a tie is noise).

        Stopped midway, the best sampled setting stays (as without one).
        """
        best = self.best
        scores = {start: [], best: []}
        for _ in range(self._confirm_rounds):
            for setting in (start, best):
                set_tunables(*setting)
                score = self._window()
                if score is None:
                    return
                scores[setting].append(score)
                self._log(setting, score, "confirm")
        med = {k: statistics.median(v) for k, v in scores.items()}
        self.confirmed = med[best] > med[start] * (1.0 + self._min_gain)
        keep = best if self.confirmed else start
        self.best, self.best_score = keep, med[keep]

    def _run(self):
        try:
            current = get_tunables()
            for _ in range(self._warmup):
                score = self._window()
                if score is None:
                    return
                self._log(current, score, "warmup")
            while self.samples < self._max_samples:
                # The first sample is the setting the job started with, so
                # tuning never ends on something worse than it measured.
                if self.samples == 0:
                    u, setting = _encode(current), current
                else:
                    u = self._search.ask()
                    setting = _decode(u)
                set_tunables(*setting)
                score = self._window()
                if score is None:
                    return
                self._search.tell(u, score)
                self.samples += 1
                if score > self.best_score:
                    self.best, self.best_score = setting, score
                self._log(setting, score, "sample")
            if self.best != current and self._confirm_rounds > 0:
                self._confirm(current)
        except Exception as e:  # the runtime shut down under us, or a bug
            self.error = e
        finally:
            try:
                if self.best is not None:
                    set_tunables(*self.best)
                    self._log(self.best, self.best_score, "final")
            except Exception as e:
                self.error = self.error or e
            if self._log_file is not None:
                self._log_file.close()
            self.done.set()


def start_autotune(log_path=None, sample_seconds=2.0, min_collectives=20,
                   warmup_samples=3, max_samples=20, seed=0,
                   confirm_rounds=3, min_gain=0.02):
    """Starts tuning in a daemon thread on rank 0 (other ranks: no-op).

    Args:
        log_path: CSV file to record every sample in (rank 0), or None.
        sample_seconds: the shortest sampling window.
        min_collectives: the fewest collective batches in a window.
        warmup_samples: windows measured first and discarded.
        max_samples: scored settings to try before settling on the best.
        seed: seeds the search (for reproducible sequences of settings).
        confirm_rounds: pairs of windows (starting setting, best sampled
            one) run after the samples when the best is not the starting
            setting. 0 keeps the best sample as it is.
        min_gain: the best is kept only if its confirmation median beats
            the starting setting's by more than this fraction.

    Returns:
        The running `Autotuner` on rank 0, None on other ranks.

    Raises:
        RuntimeError: kerasdist is not initialized, or a tuner is running.
        ImportError: scikit-learn is missing.
    """
    global _tuner
    lib = _capi.lib()
    if not lib.kerasdist_is_initialized():
        raise RuntimeError("start_autotune: kerasdist is not initialized; "
                           "call kerasdist.init() first.")
    if lib.kerasdist_rank() != 0:
        return None
    with _tuner_lock:
        if _tuner is not None and not _tuner.done.is_set():
            raise RuntimeError("start_autotune: a tuner is already running; "
                               "call stop_autotune() first.")
        try:
            import sklearn  # noqa: F401
        except ImportError as e:
            raise ImportError("kerasdist's autotuner needs scikit-learn: "
                              "`pip install scikit-learn`.") from e
        _tuner = Autotuner(log_path, sample_seconds, min_collectives,
                           warmup_samples, max_samples, seed,
                           confirm_rounds, min_gain).start()
        return _tuner


def stop_autotune(timeout=10.0):
    """Stops the tuner (if any) and returns the best setting applied.

    Returns:
        (threshold_bytes, cycle_ms, cache_enabled) or None.
    """
    global _tuner
    with _tuner_lock:
        tuner, _tuner = _tuner, None
    if tuner is None:
        return None
    return tuner.stop(timeout)


def maybe_start():
    """Starts the tuner if the runtime's `KERASDIST_AUTOTUNE` setting is on
    (called by init(); the setting comes from the environment or
    `init(autotune=True)`).

    Returns:
        The `Autotuner` on rank 0 when tuning was asked for, else None.
    """
    settings = _capi.current_settings()
    # The core prints booleans as 1 or 0 (and has parsed the value).
    if settings.get(_capi.setting_name("autotune")) != "1":
        return None
    if _capi.lib().kerasdist_rank() != 0:
        return None
    with _tuner_lock:
        if _tuner is not None and not _tuner.done.is_set():
            return _tuner
    log = settings.get(_capi.setting_name("autotune_log")) or None
    return start_autotune(log_path=log)
