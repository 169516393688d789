"""The pieces of a sharded optimizer's checkpoints that need no ranks
(kerasdist/trainer/shards.py, kerasdist/keras/sharding/): the slice
arithmetic of re-partitioning, the shard files read back at another size,
and the store's index: verified, named in errors, pruned with its
checkpoint. The Trainer writing and loading them runs on real ranks in
tests/parallel/test_trainer_shard.py."""

import json
import os

import numpy as np
import pytest

from kerasdist.keras.sharding import files as _shard_files
from kerasdist.keras.sharding import layout as _layout
from kerasdist.trainer import checkpoints
from kerasdist.trainer import shards


def _shards_of(flat, size):
    """Each rank's shard (padded) of `flat`, as the layout defines it."""
    chunk = _layout.partition([flat.size], size)[0]
    padded = np.zeros(size * chunk, flat.dtype)
    padded[:flat.size] = flat
    return chunk, [padded[r * chunk:(r + 1) * chunk] for r in range(size)]


@pytest.mark.parametrize("numel", [1, 2, 5, 7, 12, 13, 64])
def test_pieces_rebuild_every_new_shard_from_the_old_ones(numel):
    flat = np.arange(1, numel + 1, dtype=np.float64)
    for old in range(1, 6):
        chunk, files = _shards_of(flat, old)
        for new in range(1, 6):
            c = _layout.partition([numel], new)[0]
            for r in range(new):
                lo, hi = _layout.owned(numel, c, r)
                got = np.zeros(hi - lo)
                parts = _layout.pieces(numel, chunk, lo, hi)
                for k, start, stop, at in parts:
                    assert 0 <= k < old and 0 <= start < stop <= chunk
                    got[at:at + stop - start] = files[k][start:stop]
                np.testing.assert_array_equal(got, flat[lo:hi])
                # Each old rank read at most once, contiguously.
                assert len({p[0] for p in parts}) == len(parts)


def test_pieces_rejects_a_bad_range():
    assert _layout.pieces(10, 4, 3, 3) == []
    assert _layout.pieces(10, 4, 2, 9) == [(0, 2, 4, 0), (1, 0, 4, 2),
                                             (2, 0, 1, 6)]
    with pytest.raises(ValueError, match="bad range"):
        _layout.pieces(10, 4, 5, 11)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        _layout.pieces(10, 0, 0, 1)


class _Rows:
    """An array that records which rows were read (as h5py reads)."""

    def __init__(self, array):
        self.array, self.shape, self.dtype = array, array.shape, array.dtype
        self.read = []

    def __getitem__(self, key):
        self.read.append(key)
        return self.array[key]


@pytest.mark.parametrize("shape", [(7,), (5, 3), (2, 3, 4), (4, 1)])
def test_flat_range_reads_only_the_rows_it_needs(shape):
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    n = array.size
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            rows = _Rows(array)
            got = _layout.flat_range(rows, lo, hi)
            np.testing.assert_array_equal(got, array.ravel()[lo:hi])
            if len(shape) > 1 and hi > lo:
                (key,) = rows.read
                row = n // shape[0]
                assert key.start == lo // row and \
                    key.stop == -(-hi // row)


def _write_files(directory, stem, values, size, token="t"):
    """Shard files of `values` ({index: whole flat array}) at `size`."""
    numels = {i: v.size for i, v in values.items()}
    chunks = dict(zip(numels, _layout.partition(list(numels.values()),
                                                  size)))
    for r in range(size):
        mine = {i: _shards_of(v, size)[1][r] for i, v in values.items()}
        shards.write(os.path.join(directory, shards.shard_name(stem, r, size)),
                     mine, token, r, size)
    return {"format": 1, "size": size, "optimizer_variables": 5,
            "variables": [{"index": i, "path": f"v{i}", "shape": [n],
                           "numel": n, "chunk": chunks[i],
                           "dtype": "float64"} for i, n in numels.items()]}


def test_shard_files_read_back_at_another_size(tmp_path):
    values = {2: np.arange(1.0, 12.0), 3: np.arange(100.0, 103.0),
              4: np.array([7.0])}
    record = _write_files(str(tmp_path), "epoch-000001", values, 3)
    record["files"] = shards.collect(str(tmp_path), "epoch-000001", 3, "t")
    source = _shard_files.ShardFiles(str(tmp_path), record)
    try:
        for i, v in values.items():
            np.testing.assert_array_equal(source.read(i, 0, v.size), v)
            for new in (1, 2, 4):
                c = _layout.partition([v.size], new)[0]
                for r in range(new):
                    lo, hi = _layout.owned(v.size, c, r)
                    np.testing.assert_array_equal(source.read(i, lo, hi),
                                                  v[lo:hi])
    finally:
        source.close()


def test_collect_waits_for_this_writes_token(tmp_path):
    _write_files(str(tmp_path), "epoch-000002", {2: np.ones(4)}, 2,
                 token="an earlier attempt")
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"rank 0's shard file .*epoch-000002\.shard-"
                       r"00000-of-00002\.h5 of this checkpoint did not "
                       r"appear"):
        shards.collect(str(tmp_path), "epoch-000002", 2, "now", wait=0.2)


def _save(directory, epoch, values, size, samples=0, keep=3):
    stem = checkpoints.stem(epoch, samples)

    def record(name):
        assert name == stem
        out = _write_files(str(directory), stem, values, size,
                           token=f"n:{stem}")
        out["files"] = shards.collect(str(directory), stem, size,
                                      f"n:{stem}")
        return out

    def weights(path):
        with open(path, "wb") as f:
            f.write(b"weights")

    return checkpoints.save(directory, epoch, weights, {}, keep=keep,
                            samples=samples, shards=record)


def _names(path):
    return sorted(os.listdir(path))


def test_sharded_checkpoint_index_is_verified(tmp_path):
    values = {2: np.arange(6.0)}
    path = _save(tmp_path, 1, values, 2)
    with open(path) as f:
        record = json.load(f)["optimizer_shards"]
    assert [f["name"] for f in record["files"]] == [
        "epoch-000001.shard-00000-of-00002.h5",
        "epoch-000001.shard-00001-of-00002.h5"]
    assert record["variables"][0]["chunk"] == 3
    assert checkpoints.read_manifest(path)["epoch"] == 1
    shard = tmp_path / "epoch-000001.shard-00001-of-00002.h5"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"shard file {shard} does not match"):
        checkpoints.read_manifest(path)
    os.truncate(shard, 10)
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"shard file {shard} is truncated"):
        checkpoints.read_manifest(path)
    os.remove(shard)
    with pytest.raises(checkpoints.CheckpointError,
                       match=f"shard file {shard} is missing"):
        checkpoints.read_manifest(path)
    # Another rank reads the manifest rank 0 verified, without checking.
    assert checkpoints.read_manifest(path, verify=False)["epoch"] == 1


def test_shard_files_go_with_their_checkpoint(tmp_path):
    values = {2: np.arange(6.0)}
    _save(tmp_path, 1, values, 2)
    _save(tmp_path, 1, values, 2, samples=16)
    _save(tmp_path, 1, values, 3, samples=32)
    assert _names(tmp_path) == [
        "epoch-000001-sample-000000032.json",
        "epoch-000001-sample-000000032.shard-00000-of-00003.h5",
        "epoch-000001-sample-000000032.shard-00001-of-00003.h5",
        "epoch-000001-sample-000000032.shard-00002-of-00003.h5",
        "epoch-000001-sample-000000032.weights.h5",
        "epoch-000001.json",
        "epoch-000001.shard-00000-of-00002.h5",
        "epoch-000001.shard-00001-of-00002.h5",
        "epoch-000001.weights.h5"]
    # An older shard file of no checkpoint (a crash before its manifest)
    # goes; so does a file of the same name that another size left.
    (tmp_path / "epoch-000001-sample-000000008.shard-00000-of-00002.h5"
     ).write_bytes(b"x")
    (tmp_path / "epoch-000002.shard-00004-of-00005.h5").write_bytes(b"x")
    _save(tmp_path, 2, values, 1, keep=1)
    assert _names(tmp_path) == [
        "epoch-000002.json", "epoch-000002.shard-00000-of-00001.h5",
        "epoch-000002.weights.h5"]
