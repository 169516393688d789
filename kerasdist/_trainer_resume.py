"""The Trainer's resume protocol (private): which checkpoint a Trainer
continues from, and what its checkpoints record so that a rerun can
continue them."""

import numpy as np

from kerasdist import _frontend
from kerasdist import basics
from kerasdist import checkpoints

# The core's setting the launcher sets for every attempt under
# --max-restarts; current_settings() reports it (a KeyError if it is renamed).
_RESTART_ATTEMPT = "KERASDIST_RESTART_ATTEMPT"


class ResumeProtocol:
    """Where a Trainer's weights come from and which run they continue.

    A Trainer holds one. `fit()` continues from the newest checkpoint in
    its directory; a trainer made by `from_checkpoint` starts from that
    checkpoint (`source`); `fine_tune()` of such a trainer continues an
    interrupted fine-tuning of the same checkpoint over the same epochs,
    recognised by `fine_tune_key`. Rank 0 finds and loads a checkpoint and
    every rank learns the outcome (`resume_on_rank0`).

    Attributes:
        source: the manifest to load first (set by from_checkpoint), or None.
        phase: "fit" or "fine_tune": what the checkpoints written now hold.
        fine_tune_key: identifies the fine-tuning in progress, or None.
    """

    def __init__(self, source=None):
        self.source = source
        self.phase = "fit"
        self.fine_tune_key = None

    def begin_fit(self):
        self.phase, self.fine_tune_key = "fit", None

    def begin_fine_tune(self, start, end):
        """Marks a fine-tuning of epochs (start, end]; with a source
        checkpoint it gets a key so that a rerun after a crash can find
        its checkpoints."""
        self.phase = "fine_tune"
        self.fine_tune_key = None
        if self.source is not None:
            self.fine_tune_key = (f"{self.source['weights_sha256']}:"
                                  f"{start}:{end}")

    def manifest_fields(self):
        """What a checkpoint written now records for a later resume."""
        return {"phase": self.phase, "fine_tune_of": self.fine_tune_key}

    def load_source(self, load):
        """Loads `source` on rank 0 with `load(manifest)`; every rank
        learns whether it worked."""
        source = self.source
        resume_on_rank0(lambda: source, load, source["weights_path"])

    def load_latest(self, directory, load):
        """Loads the newest checkpoint in `directory` (rank 0).

        Returns:
            Its epoch count, or None when there is none (on every rank).
        """
        return resume_on_rank0(lambda: checkpoints.latest(directory), load,
                               f"the checkpoints in {directory}")

    def load_latest_fine_tune(self, directory, load):
        """Loads the newest checkpoint in `directory` if it belongs to the
        fine-tuning in progress (same key). Returns its epoch count or None.
        """
        key = self.fine_tune_key

        def find():
            manifest = checkpoints.latest(directory)
            if manifest is not None and manifest.get("fine_tune_of") == key:
                return manifest
            return None

        return resume_on_rank0(find, load, f"the checkpoints in {directory}")


def restart_attempt():
    """(name, attempt): the launcher's 0-based attempt number, from the
    runtime's settings (0 outside `kerasdist run --max-restarts`)."""
    return _RESTART_ATTEMPT, int(basics.current_settings()[_RESTART_ATTEMPT])


def resume_on_rank0(find, load, what):
    """Rank 0 finds a checkpoint with `find()` (a manifest or None) and
    loads it with `load(manifest)`; every rank learns the outcome.

    Returns:
        The number of epochs the loaded checkpoint had done, or None when
        there was none (the same on every rank).

    Raises:
        checkpoints.CheckpointError: on every rank, when rank 0 found only
            damaged checkpoints or could not load one.
    """
    code, epoch, message = 0, 0, ""
    if basics.rank() == 0:
        try:
            manifest = find()
            if manifest is not None:
                load(manifest)
                code, epoch = 1, int(manifest["epoch"])
        except Exception as e:  # the other ranks must hear about it
            code, message = 2, f"{type(e).__name__}: {e}"
    # One broadcast, also on failure: a rank that raised alone would leave
    # the others waiting in their next collective.
    status = _frontend.host_broadcast(
        np.array([code, epoch], np.int64), 0, "kerasdist.trainer.resume")
    if status[0] == 2:
        raise checkpoints.CheckpointError(
            message or f"rank 0 could not load {what}; see its error.")
    return int(status[1]) if status[0] == 1 else None
