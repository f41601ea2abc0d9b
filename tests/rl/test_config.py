"""The jobs' typed configs (rl/config.py): every config file reads, each default is written
once, and a value the job cannot run is an error that names its field."""

import dataclasses
import pathlib

import pytest

from glmjax.presets import load_config
from rl.config import (
    BaseConfig,
    DistillJobConfig,
    EnvConfig,
    EvalConfig,
    JobConfig,
    RLConfig,
    TaskConfig,
    build,
    section,
)
from rl.tasks import sandbox_limits

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["sao_tiny", "sao_agent_tiny", "compaction_tiny"])
def test_every_rl_config_file_reads_into_the_typed_config(name):
    job = JobConfig.from_config(load_config(CONFIGS / f"{name}.py"))
    assert isinstance(job.rl, RLConfig) and isinstance(job.task, TaskConfig) and isinstance(job.base, BaseConfig)
    assert (job.env is not None) == job.agentic == (name == "sao_agent_tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.rl.eta = 3


def test_the_distillation_config_reads_with_each_teachers_budgets():
    job = DistillJobConfig.from_config(load_config(CONFIGS / "opd_tiny.py"))
    assert sorted(job.teachers) == ["sorter", "speller"]
    speller = job.teacher_sft_for(job.teachers["speller"])
    assert (speller.steps, speller.demonstrations, speller.seed) == (250, 3000, 1)
    assert job.teacher_sft_for(job.teachers["sorter"]).demonstrations == job.teacher_sft.demonstrations


@pytest.mark.parametrize("cls", [TaskConfig, BaseConfig, RLConfig, EnvConfig, EvalConfig])
def test_a_section_is_its_class_defaults_and_reads_back_to_them(cls):
    assert build(cls, section(cls), cls.__name__) == cls()
    changed = build(cls, section(cls, **{dataclasses.fields(cls)[1].name: dataclasses.fields(cls)[1].default}), "x")
    assert changed == cls()


def test_a_config_file_states_only_what_differs():
    cfg = load_config(CONFIGS / "sao_agent_tiny.py")
    job = JobConfig.from_config(cfg)
    assert job.env == EnvConfig(timing=False) and job.eval == EvalConfig(matrix_tasks=50)
    assert job.rl == RLConfig(steps=200, actor_lr=5e-5, critic_lr=3e-4, critic_steps=1, validate_every=50)


def test_an_unknown_field_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"config.rl.replay has unknown field\(s\) \['row'\]; valid fields: enabled"):
        build(RLConfig, {"replay": {"row": 3}}, "rl")
    with pytest.raises(ValueError, match=r"config has unknown section\(s\) \['rll'\]"):
        cfg = load_config(CONFIGS / "sao_tiny.py")
        cfg.rll = cfg.rl
        JobConfig.from_config(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["rl.batch_size=10", "rl.group_size=4"], "rl.batch_size=10 must be a positive multiple of rl.group_size=4"),
    (["rl.algorithm=gspo"], "rl.algorithm='gspo' compares rollouts of one prompt"),
    (["rl.dynamic_sampling=True"], "rl.dynamic_sampling drops groups whose rewards are all equal"),
    (["rl.eta=-1"], r"rl.eta=-1 is invalid: expected >= 0 \(0 = synchronous\)"),
    (["rl.kl_coef=-0.1"], r"rl.kl_coef=-0.1 is invalid: expected >= 0 \(0 = off\)"),
    (["rl.temperature=0.0"], "rl.temperature=0.0 is invalid"),
    (["rl.reward_shaping=length"], "rl.reward_shaping='length' is invalid"),
    (["rl.engine_rules=serve"], "rl.engine_rules='serve' is invalid"),
    (["rl.engine_span=host"], "rl.engine_span='host' is invalid: expected 'process'"),
    (["rl.overlong_buffer=11"], "rl.overlong_buffer=11 exceeds task.max_new_tokens=10"),
    (["rl.replay.rows=0"], "rl.replay needs rows >= 1"),
    (["rl.num_draft=2"], "rl.num_draft=2 needs an MTP layer"),
    (["task.family=sortin"], "task.family='sortin' is unknown"),
    (["task.difficulty=6"], "task.difficulty=6 is invalid"),
    (["task.augment=shuffle"], r"task.augment='shuffle' names \['shuffle'\]"),
    (["task.max_len=100"], "task.max_len=100 exceeds model.max_position_embeddings=64"),
    (["base.batch_size=0"], "base.batch_size=0 is invalid: expected >= 1"),
    (["distributed.num_processes=2", "rl.batch_size=7"], "rl.batch_size=7 must split over distributed.num_processes=2"),
    (["task.data=/nowhere.jsonl"], "task.data='/nowhere.jsonl' does not exist"),
    (["task.agent=terminus"], "task.agent='terminus' drives sandboxed tasks"),
    (["task.family=lookup", "task.agent=claude"], r"task.agent='claude' is unknown: expected one of \['terminus'\]"),
    (["base.checkpoint=/nowhere"], "base.checkpoint='/nowhere' does not exist: expected a Hugging Face checkpoint"),
    (["base.finetune=True"], "base.finetune fine-tunes base.checkpoint"),
    (["rl.export_every=-1"], r"rl.export_every=-1 is invalid: expected >= 0 \(0 = off\)"),
])
def test_a_value_the_job_cannot_run_names_its_field(overrides, message):
    cfg = load_config(CONFIGS / "sao_tiny.py", ["model.num_nextn_predict_layers=0", *overrides])
    with pytest.raises(ValueError, match=message):
        JobConfig.from_config(cfg)


def test_agent_episodes_and_compaction_need_what_a_checkpoint_gives(tmp_path):
    """task.agent needs a checkpoint's chat template; compaction's markers are bytes. The
    model comes from the checkpoint's config.json, config.model's runtime fields over it."""
    from glmjax.tiny_checkpoint import MODEL

    cfg = load_config(CONFIGS / "sao_agent_tiny.py", ["task.agent=terminus"])
    with pytest.raises(ValueError, match="task.agent='terminus' talks to the engine through the chat template"):
        JobConfig.from_config(cfg)
    (tmp_path / "config.json").write_text(
        '{"model_type": "glm_moe_dsa", "vocab_size": 300, "first_k_dense_replace": 1, '
        + ", ".join(f'"{k}": {str(v).lower() if isinstance(v, bool) else v}' for k, v in MODEL.items()) + "}")
    cfg = load_config(CONFIGS / "compaction_tiny.py", [f"base.checkpoint={tmp_path}", "model.dtype=bfloat16"])
    with pytest.raises(ValueError, match="rl.compaction writes its markers in the byte vocabulary"):
        JobConfig.from_config(cfg)
    cfg = load_config(CONFIGS / "sao_tiny.py", [f"base.checkpoint={tmp_path}", "model.dtype=bfloat16",
                                                "model.hidden_size=8"])
    job = JobConfig.from_config(cfg)
    assert (job.model.vocab_size, job.model.hidden_size, job.model.dtype) == (300, MODEL["hidden_size"], "bfloat16")


def test_env_and_eval_invariants_name_their_field():
    with pytest.raises(ValueError, match="env.max_turns=0 is invalid"):
        EnvConfig(max_turns=0)
    with pytest.raises(ValueError, match="unknown action format|action_format|xml"):
        EnvConfig(action_format="xml")
    with pytest.raises(ValueError, match=r"eval.ks='1,8' is invalid"):
        EvalConfig(samples=4, ks="1,8")


def test_the_agentic_jobs_sandbox_limits_come_from_its_env_section():
    config = load_config(CONFIGS / "sao_agent_tiny.py", ["env.disk_mb=256", "env.cpus=0.5"])
    limits = sandbox_limits(JobConfig.from_config(config))
    assert (limits.wall_seconds, limits.memory_bytes, limits.disk_bytes, limits.cpus) == (5.0, 2 << 30, 256 << 20, 0.5)
    del config.env["cpus"]
    assert sandbox_limits(JobConfig.from_config(config)).cpus == 1.0  # EnvConfig's default where the file has none
