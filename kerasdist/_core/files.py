"""Files written whole or not at all, and their digests: the Trainer's
checkpoints (kerasdist/trainer/checkpoints.py) and `hvd.elastic`'s commits
(kerasdist/elastic.py) both write through here. Standard library only, so
that neither needs the other's framework."""

import hashlib
import os
import tempfile


def sha256(path):
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def discard(path):
    """Removes `path` if it is there (what a failed write left)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, write, prefix=".tmp-", fault=None):
    """Calls `write(tmp_path)` for a temporary file beside `path` (named
    `prefix`...), fsyncs it, gives it the mode `open()` would and renames
    it over `path`: a crash leaves the old file or the new one, never a
    torn one, and a failed write removes the temporary file.

    `fault(point, path)`, if given, is called at "written" (the temporary
    file) and "renamed" (`path`): the tests' fault injection."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory,
                               suffix=os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        if fault is not None:
            fault("written", tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the mode open() would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        if fault is not None:
            fault("renamed", path)
    except BaseException:
        discard(tmp)
        raise
