"""The Trainer's resume protocol (private): which checkpoint a Trainer
continues from, and what its checkpoints record so that a rerun can
continue them."""

import collections
import os

import numpy as np

from kerasdist import basics
from kerasdist._core import host as _host
from kerasdist.trainer import checkpoints

# The core's setting the launcher sets for every attempt under
# --max-restarts; current_settings() reports it (a KeyError if it is renamed).
_RESTART_ATTEMPT = "KERASDIST_RESTART_ATTEMPT"
# torchrun's count of the restarts of its worker group (--max-restarts).
_TORCHRUN_RESTARTS = "TORCHELASTIC_RESTART_COUNT"

# Where a loaded checkpoint stands, as every rank learns it: `epoch` epochs
# done plus `samples` examples of the next; `world_size` ranks wrote it;
# `rng` the random-seed counters of the model's seed generators then.
Resumed = collections.namedtuple("Resumed", "epoch samples world_size rng")


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

    def load_source(self, load, rng_count=0, load_all=None):
        """Loads `source` on rank 0 with `load(manifest)`; every rank
        learns whether it worked, and where it stands (a `Resumed`)."""
        source = self.source
        return resume_on_rank0(lambda: source, load, source["weights_path"],
                               rng_count, load_all)

    def load_latest(self, directory, load, rng_count=0, load_all=None):
        """Loads the newest checkpoint in `directory` (rank 0), after
        removing what killed writes left there.

        Returns:
            A `Resumed`, or None when there is none (on every rank).
        """
        def find():
            checkpoints.remove_temporaries(directory)
            return checkpoints.latest(directory)

        return resume_on_rank0(find, load, f"the checkpoints in {directory}",
                               rng_count, load_all)

    def load_latest_fine_tune(self, directory, load, rng_count=0,
                              load_all=None):
        """Loads the newest checkpoint in `directory` if it belongs to the
        fine-tuning in progress (same key). Returns a `Resumed` or None.
        """
        key = self.fine_tune_key

        def find():
            checkpoints.remove_temporaries(directory)
            manifest = checkpoints.latest(directory)
            if manifest is not None and manifest.get("fine_tune_of") == key:
                return manifest
            return None

        return resume_on_rank0(find, load, f"the checkpoints in {directory}",
                               rng_count, load_all)


def describe(point, end, size, scale_lr):
    """Where a job resumes from `point` (a Resumed), in words."""
    if point.epoch >= end and not point.samples:
        return (f"after its last epoch ({point.epoch} of {end} done): "
                "nothing is left to train; raise `epochs` to train more")
    where = f"at epoch {point.epoch + 1} of {end}"
    if point.samples:
        where += f", after its first {point.samples} examples"
    if point.world_size and point.world_size != size:
        changes = (["the rest of the epoch re-sharded"] if point.samples
                   else [])
        if scale_lr:
            changes.append("the learning rate rescaled")
        where += f"; written at {point.world_size} ranks, now {size}"
        if changes:
            where += ": " + " and ".join(changes)
    return where


def restart_attempt():
    """(name, attempt): the launcher's 0-based attempt number, from the
    runtime's settings; where those say 0 and torchrun started the process,
    torchrun's restart count (`--max-restarts`). 0 otherwise."""
    attempt = int(basics.current_settings()[_RESTART_ATTEMPT])
    torchrun = os.environ.get(_TORCHRUN_RESTARTS, "").strip()
    if not attempt and torchrun.isdigit():
        return _TORCHRUN_RESTARTS, int(torchrun)
    return _RESTART_ATTEMPT, attempt


def _position(manifest, rng_count):
    """[epoch, samples, world_size, *rng counters] of a manifest."""
    rng = [int(c) for c in manifest.get("rng_counters") or []]
    if len(rng) != rng_count:
        rng = [0] * rng_count  # another model's: start the epoch's streams
    return [int(manifest["epoch"]), int(manifest.get("samples", 0)),
            int(manifest.get("world_size") or 0), *rng]


def resume_on_rank0(find, load, what, rng_count=0, load_all=None):
    """Rank 0 finds a checkpoint with `find()` (a manifest or None) and
    loads it with `load(manifest)`; every rank learns the outcome.

    Args:
        rng_count: the number of seed generators of the model (the same on
            every rank), whose counters the checkpoint may record.
        load_all: None, or (the same on every rank) `load_all(manifest)`,
            which every rank then runs with the manifest rank 0 chose (a
            sharded optimizer's ranks each read their shard).

    Returns:
        A `Resumed` of the loaded checkpoint, or None when there was none
        (the same on every rank).

    Raises:
        checkpoints.CheckpointError: on every rank, when rank 0 found only
            damaged checkpoints or could not load one.
    """
    row, message = [0] + [0] * (3 + rng_count), ""
    manifest = None
    if basics.rank() == 0:
        try:
            manifest = find()
            if manifest is not None:
                load(manifest)
                row = [1] + _position(manifest, rng_count)
        except Exception as e:  # the other ranks must hear about it
            row[0], message = 2, f"{type(e).__name__}: {e}"
    # One broadcast, also on failure: a rank that raised alone would leave
    # the others waiting in their next collective.
    status = _host.host_broadcast(
        np.array(row, np.int64), 0, f"kerasdist.trainer.resume.{rng_count}")
    if status[0] == 2:
        raise checkpoints.CheckpointError(
            message or f"rank 0 could not load {what}; see its error.")
    if status[0] != 1:
        return None
    if load_all is not None:
        _load_everywhere(manifest if basics.rank() == 0 else None, load_all,
                         rng_count)
    return Resumed(int(status[1]), int(status[2]), int(status[3]),
                   [int(c) for c in status[4:]])


def _load_everywhere(manifest, load_all, rng_count):
    """Every rank runs `load_all` on the manifest rank 0 loaded (rank 0
    passes it; the others read the file it names, which rank 0 verified);
    any rank's failure raises CheckpointError on every rank."""
    path = b""
    if manifest is not None:
        path = os.fsencode(checkpoints.manifest_path(manifest))
    tag = f"kerasdist.trainer.resume_all.{rng_count}"
    length = _host.host_broadcast(np.array([len(path)], np.int64), 0,
                                  tag + ".n")
    raw = np.zeros(int(length[0]), np.uint8)
    if manifest is not None:
        raw[:] = np.frombuffer(path, np.uint8)
    raw = _host.host_broadcast(raw, 0, tag + ".path")
    message = ""
    try:
        if manifest is None:
            manifest = checkpoints.read_manifest(os.fsdecode(raw.tobytes()),
                                                 verify=False)
        load_all(manifest)
    except Exception as e:  # the other ranks must hear about it
        message = f"rank {basics.rank()}: {type(e).__name__}: {e}"
    failed = _host.host_allreduce(np.array([1 if message else 0], np.int64),
                                  basics.Max, tag + ".failed")
    if failed[0]:
        raise checkpoints.CheckpointError(
            message or "another rank could not load its part of the "
            "checkpoint; see its error.")
