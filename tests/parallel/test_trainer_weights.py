"""Trainer(shard="weights") checkpoints with real ranks
(tests/workers/trainer_weights_worker.py): trained with sharded weights at
np 2 it equals the replicated Trainer; each rank's shard file holds its
shards of the weights and of the optimizer state, the weight file none of
the sharded weights; a step-checkpoint resume ends where the straight run
ended; the np-2 checkpoints resume at np 3 sharded and replicated, a
replicated checkpoint resumes sharded, and the np-3 checkpoints resume at
np 1 in every mode, each holding exactly the state that was saved.

One launch a size; each reads what the one before wrote, so the tests run
in this order and a failure skips those after it.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import chained_job  # noqa: E402

pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

_TIMEOUT = 400


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights_ckpt")


def _job(np_, mode, root, checks):
    return chained_job("trainer_weights_worker.py", np_, mode, root,
                       checks, _TIMEOUT)


def test_trainer_shard_weights_np2(root):
    _job(2, "np2", root, ["weights_trainer_like_replicated_shard_files",
                          "weights_step_checkpoint_resume_equals_straight_"
                          "run"])


def test_trainer_shard_weights_resume_np3(root):
    _job(3, "np3", root, ["weights_resume_2_to_3_sharded_and_replicated_"
                          "exact",
                          "replicated_checkpoint_resumes_sharded_weights_"
                          "exact",
                          "weights_continue_like_replicated_np3"])


def test_trainer_shard_weights_resume_np1(root):
    _job(1, "np1", root, ["weights_resume_3_to_1_any_mode_exact"])
