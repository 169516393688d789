"""Trainer(shard=...) checkpoints with real ranks
(tests/workers/trainer_shard_worker.py): each rank writes its shard file,
rank 0 the manifest naming them; a job at np 2 is resumed at np 3 and that
one's checkpoints at np 1, sharded and replicated either way, each holding
exactly the state that was saved; a step-checkpoint resume ends where the
straight run ended; a damaged or missing shard file is named and skipped;
under the mixed_float16 policy (a LossScaleOptimizer around the sharded
one) training equals the replicated Trainer's and resumes exactly.

One launch a size; each reads what the one before wrote, so the tests run
in this order and a failure skips those after it.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import chained_job  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402

pytestmark = [pytest.mark.parallel, pytest.mark.slow,
              pytest.mark.timeout(600)]

_TIMEOUT = 300


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("shard_ckpt")


def _job(np_, mode, root, checks):
    return chained_job("trainer_shard_worker.py", np_, mode, root, checks,
                       _TIMEOUT)


def test_shard_checkpoints_np2(root):
    _job(2, "np2", root, ["shard_files_per_rank_named_in_manifest",
                          "step_checkpoint_resume_equals_straight_run",
                          "elastic_commit_writes_a_shard_file_per_rank",
                          "mixed_float16_sharded_like_replicated"])


def test_shard_resume_np3(root):
    _job(3, "np3", root, ["resume_2_to_3_sharded_exact",
                          "resume_sharded_to_replicated_exact",
                          "continues_like_replicated",
                          "resume_replicated_to_sharded_exact",
                          "elastic_resume_2_to_3_sharded_exact",
                          "elastic_replicated_commit_resumes_sharded_exact",
                          "elastic_commit_of_sharded_weights_resumes_at_3"])


def test_shard_resume_np1(root):
    out = _job(1, "np1", root, ["resume_3_to_1_and_replicated_sharded_exact",
                                "damaged_shard_file_falls_back",
                                "missing_shard_file_names_it",
                                "elastic_resume_3_to_1_replicated_and_"
                                "damaged_shard_falls_back"])
    errors = "\n".join(rank_lines(out.stdout, 0, "stderr"))
    assert "skipping damaged checkpoint: checkpoint shard file " in errors
    assert "epoch-000004.shard-00001-of-00003.h5" in errors
    text = "\n".join(rank_lines(out.stdout, 0, "stdout")) + errors
    assert "the last commit cannot be read" in text and \
        "shard-00002-of-00003.h5 is damaged" in text, text[-3000:]
