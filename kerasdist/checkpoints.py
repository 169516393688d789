"""The Trainer's checkpoint store: atomic, verified, rotated.

A directory holds one pair of files per saved epoch:

    epoch-000002.weights.h5   model weights and the whole optimizer state
    epoch-000002.json         the manifest, written last

The manifest is the commit record. It names the weight file, its size and
SHA-256, the epoch to resume from, the optimizer step, the world size and
the versions that wrote it. Both files are written to a temporary file in
the same directory and renamed over the target (`os.replace`, atomic on
POSIX), weights first and manifest second. A crash at any point therefore
leaves either the previous complete checkpoint or the new one, never a
torn one: a weight file without a manifest is not a checkpoint.

Reading goes newest first. A checkpoint whose manifest is unreadable or
whose weight file does not match the recorded size and checksum is skipped
with a warning that names the file; if every checkpoint is damaged,
`CheckpointError` says so (a job never restarts from scratch silently).

This module never runs a collective: the Trainer decides which rank
writes (rank 0) and broadcasts what rank 0 read.
"""

import glob
import hashlib
import json
import os
import re
import tempfile
import time
import warnings

MANIFEST_VERSION = 1
_WEIGHTS_SUFFIX = ".weights.h5"
_NAME_RE = re.compile(r"^epoch-(\d{6,})\.json$")


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected."""


def weights_name(epoch):
    """File name of the weights of the checkpoint after `epoch` epochs."""
    return f"epoch-{epoch:06d}{_WEIGHTS_SUFFIX}"


def manifest_name(epoch):
    """File name of the manifest of the checkpoint after `epoch` epochs."""
    return f"epoch-{epoch:06d}.json"


def file_sha256(path):
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic_write(path, write):
    """Calls `write(tmp_path)`, fsyncs, then renames tmp over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory,
                               suffix=os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the mode open() would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def check_directory(directory):
    """Raises ValueError if `directory` exists and is not a directory."""
    if directory is None:
        return
    path = os.fspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"checkpoint_dir must be a directory, but {path!r} "
                         "is a file. Pass a directory path (it is created "
                         "if missing).")


def save(directory, epoch, save_weights, info, keep=3):
    """Writes the checkpoint after `epoch` epochs; returns its manifest path.

    Args:
        directory: the checkpoint directory (created if missing).
        epoch: number of completed epochs (the epoch to resume from).
        save_weights: `save_weights(path)` writes the weight file, e.g.
            `model.save_weights`.
        info: a JSON-serialisable dict stored in the manifest (step, world
            size, versions, trainer settings).
        keep: how many of the newest checkpoints to keep (>= 1).

    Returns:
        The path of the manifest written.
    """
    os.makedirs(directory, exist_ok=True)
    weights = os.path.join(directory, weights_name(epoch))
    _atomic_write(weights, save_weights)
    manifest = dict(info, format=MANIFEST_VERSION, epoch=int(epoch),
                    weights=os.path.basename(weights),
                    weights_bytes=os.path.getsize(weights),
                    weights_sha256=file_sha256(weights),
                    written_at=time.time())
    path = os.path.join(directory, manifest_name(epoch))

    def write_manifest(tmp):
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)

    _atomic_write(path, write_manifest)
    prune(directory, keep)
    return path


def list_epochs(directory):
    """Epochs that have a manifest in `directory`, newest first."""
    epochs = []
    for path in glob.glob(os.path.join(glob.escape(directory), "*.json")):
        m = _NAME_RE.match(os.path.basename(path))
        if m:
            epochs.append(int(m.group(1)))
    return sorted(epochs, reverse=True)


def prune(directory, keep):
    """Deletes all but the `keep` newest checkpoints (manifest first, so a
    half-deleted checkpoint is never mistaken for a complete one), and
    weight files that lost their manifest."""
    epochs = list_epochs(directory)
    for epoch in epochs[keep:]:
        for name in (manifest_name(epoch), weights_name(epoch)):
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    kept = {weights_name(e) for e in epochs[:keep]}
    for path in glob.glob(os.path.join(glob.escape(directory),
                                       "epoch-*" + _WEIGHTS_SUFFIX)):
        if os.path.basename(path) not in kept:
            # A crash between the two renames of `save` leaves one; only
            # ones older than the newest manifest are safe to delete.
            m = re.match(r"^epoch-(\d+)", os.path.basename(path))
            if epochs and int(m.group(1)) < epochs[0]:
                os.remove(path)


def read_manifest(path):
    """Reads and verifies one checkpoint.

    Returns:
        The manifest dict with `weights_path` added (absolute).

    Raises:
        CheckpointError: naming the file, if the manifest cannot be read or
            the weight file is missing, has the wrong size or checksum.
    """
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        weights = os.path.join(os.path.dirname(os.path.abspath(path)),
                               manifest["weights"])
        int(manifest["epoch"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable checkpoint manifest {path}: "
                              f"{e}") from None
    if not os.path.exists(weights):
        raise CheckpointError(f"checkpoint weight file {weights} is missing")
    size = os.path.getsize(weights)
    if size != manifest.get("weights_bytes"):
        raise CheckpointError(
            f"checkpoint weight file {weights} is truncated or damaged: "
            f"{size} bytes, the manifest recorded "
            f"{manifest.get('weights_bytes')}")
    if file_sha256(weights) != manifest.get("weights_sha256"):
        raise CheckpointError(f"checkpoint weight file {weights} does not "
                              "match the checksum in its manifest")
    manifest["weights_path"] = weights
    return manifest


def latest(directory, warn=True):
    """The newest checkpoint in `directory` that verifies, or None if the
    directory has no checkpoint at all.

    Damaged checkpoints are skipped with a warning naming the file.

    Raises:
        CheckpointError: if there are checkpoints but none verifies.
    """
    if directory is None or not os.path.isdir(directory):
        return None
    epochs = list_epochs(directory)
    problems = []
    for epoch in epochs:
        path = os.path.join(directory, manifest_name(epoch))
        try:
            return read_manifest(path)
        except CheckpointError as e:
            problems.append(str(e))
            if warn:
                warnings.warn(f"kerasdist.Trainer: skipping damaged "
                              f"checkpoint: {e}; falling back to an older "
                              "one.", RuntimeWarning, stacklevel=2)
    if problems:
        raise CheckpointError(
            f"Every checkpoint in {directory} is damaged, so training "
            "cannot resume: " + "; ".join(problems) + ". Move the directory "
            "away to start from scratch, or pass auto_resume=False.")
    return None


def resolve(path):
    """A checkpoint directory, manifest or weight file -> verified manifest.

    Raises:
        CheckpointError: if nothing usable is found at `path`.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        manifest = latest(path)
        if manifest is None:
            raise CheckpointError(f"no checkpoint in directory {path}")
        return manifest
    if path.endswith(_WEIGHTS_SUFFIX):
        path = path[:-len(_WEIGHTS_SUFFIX)] + ".json"
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    return read_manifest(path)
