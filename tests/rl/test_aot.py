"""glmjax-aot: the SAO job's programs compiled for a TPU slice described by libtpu (no TPU here)."""

import json

import pytest

from rl import aot, model_flops
from glmjax.config import ModelConfig
from glmjax.presets import load_config
from tests.presets_util import REPO

# A small slice (4 chips) and the sorting job at 1 layer: the three roles compile in seconds.
# Data parallel: at this size, on fsdp / expert meshes, libtpu's compile of the actor step stops
# with a RET_CHECK in its all-reduce-scatter fusion of the LM head's sliced logits.
TINY = ["--config.mesh.data=4", "--config.model.num_hidden_layers=1", "--config.model.index_topk_pattern=F",
        "--config.rl.critic_steps=1", "--config.rl.batch_size=8", "--config.rl.slots=8", "--config.task.max_len=16",
        "--config.task.max_new_tokens=8"]
ROLE_KEYS = {"bytes_per_device", "planned_bytes_per_device", "flops_per_device", "bytes_accessed_per_device",
             "analytic_flops_per_device", "roofline_seconds", "compile_seconds", "spmd_warnings", "steps",
             "persistent_bytes_per_device", "bytes_combined_as", "fits", "mesh", "devices", "shape", "planned"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("aot") / "tiny.json"
    status = aot.main(["--config", str(REPO / "configs/sao_tiny.py"), "--topology", "v5p:2x2x1", "--json", str(path),
                       *TINY])
    assert status == 0
    return json.loads(path.read_text())


def test_report_has_every_role_and_key(report):
    assert set(report["roles"]) == set(aot.ROLES)
    for key in ("hbm_bytes_per_device", "fits", "spmd_warnings", "topology", "mesh", "engine_mesh", "overrides",
                "wall_seconds", "chip"):
        assert key in report, key
    assert report["topology"] == "v5p:2x2x1" and report["chips"] == 4 and report["mesh"] == {"data": 4}
    assert report["overrides"] == TINY and report["fits"] and report["spmd_warnings"] == 0
    for name, role in report["roles"].items():
        assert ROLE_KEYS <= set(role), (name, ROLE_KEYS - set(role))
        keys = ("bytes_per_device", "planned_bytes_per_device", "compile_seconds")
        if name != "publish":  # a publish does no arithmetic
            keys += ("flops_per_device", "bytes_accessed_per_device", "analytic_flops_per_device", "roofline_seconds")
        for key in keys:
            assert role[key] > 0, (name, key, role[key])


def test_learner_step_combines_the_critic_and_actor_steps(report):
    role = report["roles"]["learner_step"]
    steps = {s["name"]: s for s in role["steps"]}
    assert set(steps) == {"critic_phase", "actor_step"}
    peak = max(s["bytes_per_device"] + role["persistent_bytes_per_device"] - s["persistent_argument_bytes"]
               for s in steps.values())
    assert role["bytes_per_device"] == peak
    assert role["flops_per_device"] == pytest.approx(sum(s["flops_per_device"] for s in steps.values()))


def test_compiled_figures_agree_with_the_plan_and_the_flop_count(report):
    for name, role in report["roles"].items():
        if name == "publish":
            continue
        # at this size the chips' (8, 128) tiles pad every small array: a factor, not a percentage
        assert 0.1 <= role["planned_bytes_per_device"] / role["bytes_per_device"] <= 10, name
        assert 0.5 <= role["flops_per_device"] / role["analytic_flops_per_device"] <= 2.0, name


def test_analytic_flops_equal_a_hand_count():
    # one dense layer attending densely (index_topk >= T), an indexer that only makes keys
    c = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                    num_experts_per_tok=2, first_k_dense_replace=1, index_topk=64, index_n_heads=4,
                    index_head_dim=16, num_nextn_predict_layers=0)
    d, q, h, k, r, cl, v, f, i, n = 64, 32, 4, 16, 8, 32, 16, 128, 16, 256
    t = 8
    mla = d * q + q * h * (k + r) + d * (cl + r) + h * k * cl + h * cl * v + h * v * d
    keys = sum(range(1, t + 1)) / t  # causal: query j sees j + 1 keys
    per_token = 2 * (mla + keys * h * (2 * cl + r) + 3 * d * f)
    trained, indexer = model_flops.forward_flops(c, 2 * t, t)
    assert trained == pytest.approx(2 * t * (per_token + 2 * d * n))
    assert indexer == pytest.approx(2 * t * 2 * d * i)
    job = type("Job", (), {})()
    job.model, job.task = c, type("Task", (), {"max_len": t})()
    job.rl = type("RL", (), dict(batch_size=2, uses_critic=False, kl_coef=0.0, critic_steps=0, replay=None,
                                 compaction=type("C", (), {"enabled": False})()))()
    job.rl.replay = type("R", (), {"enabled": False})()
    assert model_flops.analytic_flops(job, "learner_step", devices=2) == pytest.approx((3 * trained + indexer) / 2)


@pytest.mark.parametrize("arg", [None, "h200"])
def test_glm53_sao_builds_its_job_config(arg):
    from rl.config import JobConfig

    cfg = load_config(REPO / "configs/glm53_sao.py", arg=arg)
    cfg.distributed.num_processes = -1  # the job's hosts, not this machine's devices
    job = JobConfig.from_config(cfg)
    assert job.model.num_hidden_layers == 78 and job.model.param_dtype == "bfloat16"
    assert job.model.scan_layers and job.model.remat == "full" and job.rl.algorithm == "sao"
    assert dict(cfg.mesh)["fsdp"] * dict(cfg.mesh)["expert"] == (256 if arg is None else 128)


def test_model_presets_name_the_job_configs_that_use_them(capsys):
    from rl import cli

    for preset in ("glm5.py", "glm53.py"):
        with pytest.raises(SystemExit):
            cli.run(["--config", str(REPO / "configs" / preset), "--workdir", "/tmp/glmjax-unused"])
        assert "configs/glm53_sao.py" in capsys.readouterr().err


def test_the_publish_brings_each_chip_about_its_share_of_the_engine(tmp_path):
    """fsdp=2 x expert=2 for the learner, the serving rules for the engine on the same 4
    chips: the publish program's collectives bring each chip at most 1.1x its share of the
    engine's parameters, with no involuntary full rematerialization."""
    path = tmp_path / "publish.json"
    status = aot.main(["--config", str(REPO / "configs/sao_tiny.py"), "--topology", "v5p:2x2x1", "--json", str(path),
                       "--roles", "publish", "--config.mesh.fsdp=2", "--config.mesh.expert=2",
                       "--config.rl.engine_rules=decode", *TINY[1:]])
    assert status == 0
    role = json.loads(path.read_text())["roles"]["publish"]
    assert role["spmd_warnings"] == 0
    assert 0 < role["steps"][0]["collective_bytes_per_device"] <= 1.1 * role["engine_share_bytes"]
    assert role["collective_bytes_over_share"] == role["steps"][0]["collective_bytes_per_device"] / role[
        "engine_share_bytes"]
