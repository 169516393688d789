"""The Trainer's checkpoint store: atomic, verified, rotated.

A directory holds one pair of files per checkpoint:

    epoch-000002.weights.h5   model weights and the whole optimizer state
    epoch-000002.json         the manifest, written last

and, for a sharded optimizer (`Trainer(shard=...)`), one shard file per
rank, written by that rank, which the manifest names with their sizes and
checksums (`epoch-000002.shard-00001-of-00002.h5`; the weight file then
holds only the optimizer variables every rank shares; see
kerasdist/trainer/shards.py).

An epoch checkpoint is named after the epochs it completed. A step
checkpoint, written in the middle of an epoch, also names how many examples
of the next epoch were trained: `epoch-000002-sample-000000480` holds the
state after 2 epochs and the first 480 examples of the third. Checkpoints
are ordered by (epochs, samples); the newest is the one to resume from.

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
import json
import os
import re
import time
import warnings

from kerasdist._core import files as _files
from kerasdist._core import resize as _resize

MANIFEST_VERSION = 1
_WEIGHTS_SUFFIX = ".weights.h5"
_TMP_PREFIX = ".tmp-"
_SHARD_RE = re.compile(r"^epoch-(\d{6,})(?:-sample-(\d{9,}))?"
                       r"\.shard-\d{5,}-of-\d{5,}\.h5$")
_NAME_RE = re.compile(r"^epoch-(\d{6,})(?:-sample-(\d{9,}))?\.json$")
_WEIGHTS_RE = re.compile(r"^epoch-(\d{6,})(?:-sample-(\d{9,}))?"
                         + re.escape(_WEIGHTS_SUFFIX) + "$")

# Fault injection for the tests (tests/workers/trainer_fault_worker.py):
# when set, called as `_fault_hook(point, path)` at the points of a write
# where a crash leaves a different state on disk ("written": the temporary
# file is complete but not synced or renamed; "renamed": `path` is in
# place; "committed": the manifest is in place, older checkpoints not yet
# pruned). None in normal use.
_fault_hook = None


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected."""


def stem(epoch, samples=0):
    """The name shared by the files of the checkpoint after `epoch`
    epochs (and `samples` examples of the next one)."""
    return _stem(epoch, samples)


def _stem(epoch, samples=0):
    if samples:
        return f"epoch-{epoch:06d}-sample-{samples:09d}"
    return f"epoch-{epoch:06d}"


def weights_name(epoch, samples=0):
    """File name of the weights of the checkpoint after `epoch` epochs (and
    `samples` examples of the next one)."""
    return _stem(epoch, samples) + _WEIGHTS_SUFFIX


def manifest_name(epoch, samples=0):
    """File name of the manifest of the checkpoint after `epoch` epochs (and
    `samples` examples of the next one)."""
    return _stem(epoch, samples) + ".json"


def _fault(point, path):
    if _fault_hook is not None:
        _fault_hook(point, path)


file_sha256 = _files.sha256


def atomic_write(path, write):
    """Calls `write(tmp_path)` for a temporary file beside `path`, fsyncs
    it, then renames it over `path` (a crash leaves the old file or the
    new one, never a torn one)."""
    _atomic_write(path, write)


def _atomic_write(path, write):
    """Calls `write(tmp_path)`, fsyncs, then renames tmp over `path`."""
    _files.atomic_write(path, write, prefix=_TMP_PREFIX, fault=_fault)


def check_directory(directory):
    """Raises ValueError if `directory` exists and is not a directory."""
    if directory is None:
        return
    path = os.fspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"checkpoint_dir must be a directory, but {path!r} "
                         "is a file. Pass a directory path (it is created "
                         "if missing).")


def save(directory, epoch, save_weights, info, keep=3, samples=0,
         shards=None):
    """Writes a checkpoint; returns its manifest path.

    Args:
        directory: the checkpoint directory (created if missing).
        epoch: number of completed epochs (the epoch to resume from).
        save_weights: `save_weights(path)` writes the weight file, e.g.
            `model.save_weights`.
        info: a JSON-serialisable dict stored in the manifest (step, world
            size, versions, trainer settings).
        keep: how many of the newest epoch checkpoints to keep (>= 1).
        samples: for a step checkpoint, the examples of epoch `epoch + 1`
            already trained (> 0); 0 for an epoch checkpoint.
        shards: for a sharded optimizer, `shards(stem)` returns the
            manifest's `optimizer_shards` record once every rank's shard
            file of the checkpoint `stem` is in place (after the weight
            file is written, before the manifest).

    Returns:
        The path of the manifest written.
    """
    os.makedirs(directory, exist_ok=True)
    weights = os.path.join(directory, weights_name(epoch, samples))
    _atomic_write(weights, save_weights)
    if shards is not None:
        info = dict(info, optimizer_shards=shards(_stem(epoch, samples)))
    manifest = dict(info, format=MANIFEST_VERSION, epoch=int(epoch),
                    samples=int(samples),
                    weights=os.path.basename(weights),
                    weights_bytes=os.path.getsize(weights),
                    weights_sha256=file_sha256(weights),
                    written_at=time.time())
    path = os.path.join(directory, manifest_name(epoch, samples))

    def write_manifest(tmp):
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)

    _atomic_write(path, write_manifest)
    _fsync_directory(directory)
    _resize.report_progress()  # the launcher restarts a failure at once
    _fault("committed", path)
    if shards is not None:  # another attempt's files of this name
        named = {f["name"] for f in info["optimizer_shards"]["files"]}
        _remove(directory, [n for n in _shard_files(directory,
                                                    (epoch, samples))
                            if n not in named])
    prune(directory, keep)
    return path


def _fsync_directory(directory):
    """Makes the renames in `directory` durable (not only atomic)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # a platform without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parse(regex, name):
    m = regex.match(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2) or 0)


def list_checkpoints(directory):
    """(epoch, samples) of every checkpoint with a manifest in `directory`,
    newest first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "*.json")):
        key = _parse(_NAME_RE, os.path.basename(path))
        if key is not None:
            found.append(key)
    return sorted(found, reverse=True)


def list_epochs(directory):
    """Epochs that have an epoch checkpoint in `directory`, newest first."""
    return [e for e, samples in list_checkpoints(directory) if not samples]


def _remove(directory, names):
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass


def prune(directory, keep):
    """Deletes what is no longer needed, manifests first (a half-deleted
    checkpoint is never mistaken for a complete one): all but the `keep`
    newest epoch checkpoints; every step checkpoint but the newest, and
    that one too once an epoch checkpoint is newer; weight files without a
    manifest that are older than the newest manifest."""
    found = list_checkpoints(directory)
    epochs = [key for key in found if not key[1]]
    steps = [key for key in found if key[1]]
    doomed = epochs[keep:] + steps[1:]
    if steps and epochs and epochs[0] > steps[0]:
        doomed.append(steps[0])
    for key in doomed:
        _remove(directory, [manifest_name(*key), weights_name(*key)])
        _remove(directory, _shard_files(directory, key))
    if found:
        kept = [key for key in found if key not in doomed]
        _remove_orphans(directory, found[0], kept)


def _remove_orphans(directory, newest, kept):
    """Deletes weight files older than the checkpoint `newest` that belong
    to no checkpoint in `kept`. A crash between the two renames of `save`
    leaves one; a newer one may be a write in progress, so it stays."""
    keep = {weights_name(*key) for key in kept}
    for path in glob.glob(os.path.join(glob.escape(directory),
                                       "epoch-*" + _WEIGHTS_SUFFIX)):
        name = os.path.basename(path)
        key = _parse(_WEIGHTS_RE, name)
        if key is not None and key < newest and name not in keep:
            _remove(directory, [name])
    for path in glob.glob(os.path.join(glob.escape(directory),
                                       "epoch-*.shard-*.h5")):
        name = os.path.basename(path)
        key = _parse(_SHARD_RE, name)
        if key is not None and key < newest and key not in kept:
            _remove(directory, [name])


def _shard_files(directory, key):
    """Names of the shard files of checkpoint `key` in `directory`."""
    pattern = glob.escape(_stem(*key)) + ".shard-*.h5"
    return [os.path.basename(p) for p in
            glob.glob(os.path.join(glob.escape(directory), pattern))
            if _parse(_SHARD_RE, os.path.basename(p)) == tuple(key)]


def remove_temporaries(directory):
    """Deletes the temporary files that a write killed midway left in
    `directory`. Call it only while nothing writes there (before training
    starts). Returns the names removed."""
    if directory is None or not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory)
                   if n.startswith(_TMP_PREFIX))
    _remove(directory, names)
    return names


def manifest_path(manifest):
    """The path of the manifest `read_manifest` returned."""
    weights = manifest["weights_path"]
    return weights[:-len(_WEIGHTS_SUFFIX)] + ".json"


def read_manifest(path, verify=True):
    """Reads and verifies one checkpoint (with `verify=False`, reads the
    manifest only: for a checkpoint another rank verified).

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
        int(manifest.get("samples", 0))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable checkpoint manifest {path}: "
                              f"{e}") from None
    if not verify:
        manifest["weights_path"] = weights
        return manifest
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
    _verify_shards(path, manifest)
    manifest["weights_path"] = weights
    return manifest


def _verify_shards(path, manifest):
    """Checks the shard files a sharded optimizer's checkpoint names
    (kerasdist/trainer/shards.py): present, of the recorded size and
    SHA-256."""
    record = manifest.get("optimizer_shards")
    if record is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    try:
        files = list(record["files"])
        if len(files) != int(record["size"]):
            raise ValueError("not one shard file a rank")
        for entry in record["variables"]:
            int(entry["index"]), int(entry["numel"]), int(entry["chunk"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable shard index in checkpoint "
                              f"manifest {path}: {e}") from None
    for entry in files:
        shard = os.path.join(directory, entry["name"])
        if not os.path.exists(shard):
            raise CheckpointError(f"checkpoint shard file {shard} is "
                                  "missing")
        size = os.path.getsize(shard)
        if size != entry.get("bytes"):
            raise CheckpointError(
                f"checkpoint shard file {shard} is truncated or damaged: "
                f"{size} bytes, the manifest recorded {entry.get('bytes')}")
        if file_sha256(shard) != entry.get("sha256"):
            raise CheckpointError(f"checkpoint shard file {shard} does not "
                                  "match the checksum in its manifest")


def latest(directory, warn=True):
    """The newest checkpoint in `directory` that verifies, or None if the
    directory has no checkpoint at all.

    Damaged checkpoints are skipped with a warning naming the file.

    Raises:
        CheckpointError: if there are checkpoints but none verifies.
    """
    if directory is None or not os.path.isdir(directory):
        return None
    problems = []
    for key in list_checkpoints(directory):
        path = os.path.join(directory, manifest_name(*key))
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
