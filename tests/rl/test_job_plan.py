"""rl/job_plan.py: the RL job's programs planned in the layouts the job gives them."""

import pathlib

import pytest

from glmjax.presets import load_config
from rl import job_plan

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_job_roles_place_the_engine_over_the_whole_slice():
    cfg = load_config(REPO / "configs/glm53_sao.py", ["model.num_hidden_layers=4"], arg="h200")
    roles = job_plan.job_roles(cfg, devices_per_host=8)
    assert set(roles) == set(job_plan.ROLES)
    assert roles["learner_step"]["mesh"] == {"fsdp": 32, "expert": 4}
    assert roles["engine_decode"]["mesh"] == {"fsdp": 32, "expert": 4}  # no host holds the model: every GPU
    learner = roles["learner_step"]
    # SAO: a critic as large as the policy; Adam's two bf16 moments of every parameter but the
    # indexers' and the MTP layer's (at 4 layers the MTP layer is a fifth of them)
    assert learner["critic"] == pytest.approx(learner["policy"], rel=1e-3)
    assert learner["policy"] < learner["actor_optimizer"] < 2 * learner["policy"]
    assert learner["total"] > sum(learner[k] for k in ("policy", "actor_optimizer", "critic", "critic_optimizer"))
