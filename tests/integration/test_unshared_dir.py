"""A checkpoint directory that is not one directory for every rank
(issue 49, item 5) is refused before the first checkpoint, in one line
naming it and the ranks that cannot see it
(tests/workers/unshared_dir_worker.py: Trainer(shard=...), each rank in a
working directory of its own, the directory named by one relative path).
Before, rank 0 waited 10 minutes at the first checkpoint for rank 1's
shard file, which went to rank 1's own directory."""

import re

import pytest

from tests.support.helpers import launch
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env

pytestmark = [pytest.mark.parallel, pytest.mark.slow]

# TensorFlow's import and one small model on two ranks on a loaded
# machine; far below the 600 s that rank 0 waited for the shard file.
_TIMEOUT = 150


@pytest.mark.timeout(_TIMEOUT + 60)
def test_unshared_checkpoint_dir_is_named_before_the_first_checkpoint(
        tmp_path):
    out = launch(2, worker_cmd("unshared_dir_worker.py", str(tmp_path)),
                 timeout=_TIMEOUT, env=worker_env())
    assert out.returncode != 0, out.stdout[-4000:]
    assert "fit started" in out.stdout, out.stdout[-4000:]
    assert "trained" not in out.stdout, out.stdout[-4000:]
    assert re.search(r"checkpoint_dir 'ckpt' is not shared by every rank: "
                     r"rank 1 cannot see rank 0's files in it",
                     out.stdout), out.stdout[-4000:]
    # No shard file was written: the check came first.
    for r in (0, 1):
        ckpt = tmp_path / f"rank{r}" / "ckpt"
        assert not list(ckpt.glob("*.h5")), list(ckpt.iterdir())
