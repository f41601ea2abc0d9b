"""The RL and distillation jobs' configs, typed: one frozen dataclass per config section.

A job's config file is an ml-collections ConfigDict (configs/sao_tiny.py), overridden from
the command line (`--config.rl.eta=0`); the job reads it once into these classes, the way
`glmjax.presets.model_config_from` reads `config.model` into a `ModelConfig`:

    job = JobConfig.from_config(cfg)        # every default written once, here
    job.rl.group_size, job.task.max_len, job.env.workers if job.env else ...

Each class checks its own invariants in `__post_init__`, naming the field
(`rl.batch_size=...`), and `JobConfig` those that span sections (`task.max_len` against the
model's context). A key the class does not have is an error that lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

from envs import families
from envs.reward import SHAPINGS
from glmjax import distributed, presets
from glmjax.config import ModelConfig
from rl.algorithms import ALGORITHMS


def _plain(section) -> dict:
    if section is None:
        return {}
    if isinstance(section, ml_collections.ConfigDict):
        return section.to_dict()
    return dict(section)


def build(cls, section, name: str):
    """`cls` (a config dataclass) from a ConfigDict or mapping; nested config sections of
    its fields are built the same way. `name` is the section's path for errors ("rl")."""
    values = _plain(section)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"config.{name} has unknown field(s) {unknown}; valid fields: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        kind = hints[key]
        nested = next((t for t in _members(kind) if dataclasses.is_dataclass(t)), None)
        if nested is not None and value is not None and not dataclasses.is_dataclass(value):
            value = build(nested, value, f"{name}.{key}")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def section(cls, **values) -> ml_collections.ConfigDict:
    """A config file's section for `cls`: its defaults, with `values` over them, as the
    ConfigDict that command-line overrides edit and `build` reads back. Config files state
    only where they differ from the defaults, which are written once, in these classes."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; valid fields: {', '.join(fields)}")
    out = {}
    for name, f in fields.items():
        if name in values:
            value = values[name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            raise ValueError(f"{cls.__name__}.{name} has no default: give it")
        if dataclasses.is_dataclass(value):
            value = section(type(value), **{k.name: getattr(value, k.name) for k in dataclasses.fields(value)})
        elif isinstance(value, Mapping) and not isinstance(value, ml_collections.ConfigDict):
            nested = next((t for t in _members(typing.get_type_hints(cls)[name]) if dataclasses.is_dataclass(t)), None)
            value = section(nested, **value) if nested else ml_collections.ConfigDict(value)
        out[name] = value
    return ml_collections.ConfigDict(out)


def _members(kind) -> tuple:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return typing.get_args(kind)
    return (kind,)


def _at_least(section: str, obj, minimum, *names: str, note: str = "") -> None:
    for field in names:
        value = getattr(obj, field)
        if value < minimum:
            raise ValueError(f"{section}.{field}={value!r} is invalid: expected >= {minimum}{note}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """`config.task`: where the tasks come from and how long their transcripts may be."""

    family: str = "sorting"  # a family of envs/families (text or sandboxed)
    difficulty: int | None = 2  # 1..5, or None for every level
    seed: int = 0
    train_tasks: int = 4000
    eval_tasks: int = 200  # held out
    max_len: int = 28  # tokens of a whole transcript (prompt, answer, observations)
    max_new_tokens: int = 10  # answer tokens of a one-turn task (all segments, with compaction)
    augment: str = ""  # adversarial copies of training tasks (envs/augment.py): "distractor", "reorder"
    augment_fraction: float = 0.5
    harbor_dir: str = ""  # tasks from a directory of Harbor tasks instead of a family
    # one-turn tasks from a JSONL prompt dataset (a file, or a directory of *.jsonl) instead of a
    # family: envs/datasets.py; rows without a "split" field are held out by this fraction
    data: str = ""
    heldout_fraction: float = 0.1
    # sandboxed tasks driven by an agent of envs/agents (AGENTS, e.g. "terminus") through the
    # engine's OpenAI-compatible API, its calls recorded token for token (rl/agent_episode.py)
    agent: str = ""

    def __post_init__(self):
        if self.data:
            if not os.path.exists(self.data):
                raise ValueError(f"task.data={self.data!r} does not exist: expected a JSONL file or a directory of them")
            if self.harbor_dir:
                raise ValueError("task.data and task.harbor_dir both name tasks: give one")
            if not 0.0 <= self.heldout_fraction < 1.0:
                raise ValueError(f"task.heldout_fraction={self.heldout_fraction} is invalid: expected 0 <= f < 1")
        elif self.harbor_dir:
            if not os.path.isdir(self.harbor_dir):
                raise ValueError(f"task.harbor_dir={self.harbor_dir!r} is not a directory")
        elif self.family not in families.TEXT and self.family not in families.SANDBOX:
            raise ValueError(f"task.family={self.family!r} is unknown: expected a text family {sorted(families.TEXT)} "
                             f"or a sandboxed one {sorted(families.SANDBOX)} (or task.harbor_dir=DIR)")
        if self.agent:
            from envs.agents import AGENTS

            if self.agent not in AGENTS:
                raise ValueError(f"task.agent={self.agent!r} is unknown: expected one of {sorted(AGENTS)}")
            if not self.agentic:
                raise ValueError(f"task.agent={self.agent!r} drives sandboxed tasks: give a sandboxed task.family "
                                 f"{sorted(families.SANDBOX)} or task.harbor_dir")
        bad = set(self.augment_kinds) - {"distractor", "reorder"}
        if bad:
            raise ValueError(f"task.augment={self.augment!r} names {sorted(bad)}: expected distractor and/or reorder")
        if self.difficulty is not None and not 1 <= self.difficulty <= 5:
            raise ValueError(f"task.difficulty={self.difficulty!r} is invalid: expected 1..5, or None for all")
        _at_least("task", self, 1, "train_tasks", "eval_tasks", "max_len", "max_new_tokens")
        if not 0.0 <= self.augment_fraction <= 1.0:
            raise ValueError(f"task.augment_fraction={self.augment_fraction} is invalid: expected 0..1")

    @property
    def augment_kinds(self) -> list[str]:
        return [k.strip() for k in self.augment.split(",") if k.strip()]

    @property
    def agentic(self) -> bool:
        """Multi-turn episodes in sandboxes (rather than one-turn answers)."""
        return not self.data and (bool(self.harbor_dir) or self.family in families.SANDBOX)


@dataclasses.dataclass(frozen=True)
class BaseConfig:
    """`config.base` (and the distillation job's `student` and `teacher_sft`): the starting
    point of RL. Without `checkpoint`, a model of `config.model` trained on demonstrations;
    with it, a Hugging Face directory (config.json, safetensors, tokenizer, chat template):
    the policy, the critic's trunk (or `critic_checkpoint`'s), the KL reference and the
    engine's model, in the checkpoint's tokenizer and chat format; `finetune` runs the
    supervised phase on the task's demonstrations first."""

    checkpoint: str = ""
    critic_checkpoint: str = ""
    finetune: bool = False

    demonstrations: int = 3000
    steps: int = 90
    batch_size: int = 64
    seq_len: int = 28
    learning_rate: float = 3e-3
    warmup: int = 20
    mtp_weight: float = 0.3
    seed: int = 0
    # DSA's training stage (glmjax/train.py): "sparse" trains the indexer from the attention
    # it serves; None trains the LM losses only
    indexer_stage: str | None = "sparse"

    def __post_init__(self):
        for key in ("checkpoint", "critic_checkpoint"):
            path = getattr(self, key)
            if path and not os.path.isfile(os.path.join(path, "config.json")):
                what = "does not exist" if not os.path.exists(path) else "has no config.json"
                raise ValueError(f"base.{key}={path!r} {what}: expected a Hugging Face checkpoint directory "
                                 "(config.json, *.safetensors, tokenizer files)")
        if self.critic_checkpoint and not self.checkpoint:
            raise ValueError("base.critic_checkpoint needs base.checkpoint: the critic's trunk and the policy share "
                             "one architecture and tokenizer")
        if self.finetune and not self.checkpoint:
            raise ValueError("base.finetune fine-tunes base.checkpoint: without one the base is always trained on "
                             "demonstrations")
        _at_least("base", self, 1, "demonstrations", "batch_size", "seq_len")
        _at_least("base", self, 0, "steps", "warmup")

    def optimizer(self) -> dict:
        """The fields glmjax/train.py's make_optimizer reads."""
        return {"learning_rate": self.learning_rate, "warmup": self.warmup, "steps": self.steps}


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """`rl.replay`: prioritized replay (rl/replay.py: BatchReplay), `rows` stored rows beside
    each batch's fresh ones."""

    enabled: bool = False
    capacity: int = 1024
    rows: int = 16
    alpha: float = 0.6
    beta: float = 0.4

    def __post_init__(self):
        if self.rows < 1 or self.capacity < self.rows:
            raise ValueError(f"rl.replay needs rows >= 1 and capacity >= rows, got rows={self.rows}, "
                             f"capacity={self.capacity}")


@dataclasses.dataclass(frozen=True)
class CompactionConfig:
    """`rl.compaction`: trajectories longer than the window are summarised and continued
    (rl/compaction.py)."""

    enabled: bool = False
    summary_tokens: int = 6
    max_segments: int = 4


ROUTING_REPLAY = ("off", "measure", "on")
ROLLOUT_CORRECTIONS = ("none", "tis", "sequence_mask")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """`config.rl`: the RL loop, its algorithm (rl/algorithms.py) and its engine."""

    algorithm: str = "sao"  # a name in rl.algorithms.ALGORITHMS
    steps: int = 300  # learner steps
    batch_size: int = 64  # rollouts per learner step
    group_size: int = 1  # rollouts per prompt (G of GRPO-style baselines; SAO: 1)
    slots: int = 64  # the engine's concurrent decodes
    eta: int = 2  # staleness admission: versions a batch may start ahead (0: synchronous)
    tau: int = 4  # rollouts finishing more than tau versions behind are dropped
    temperature: float = 0.5
    eps_low: float = 0.2  # the importance-ratio band (1 - eps_low, 1 + eps_high)
    eps_high: float = 4.0
    alpha: float = 1.5  # SAO's length-adaptive lambda_policy = 1 - 1/(alpha l)
    gamma: float = 1.0
    actor_lr: float = 1e-4
    critic_lr: float = 1e-3
    critic_steps: int = 2  # critic updates per batch (K)
    critic_warmup: int = 10  # steps that train only the critic
    freeze_critic_attention: bool = False
    grad_clip: float = 1.0
    actor_warmup: int = 0  # actor updates over which actor_lr ramps up linearly from 0
    kl_coef: float = 0.0  # beta of a KL(policy || base) term in the actor's loss (0: off)
    # generation pauses while a complete next batch waits: the engine and the learner share the machine
    generation_yields: bool = True
    num_draft: int = 0  # MTP drafts per decode step in the rollouts (0: off)
    mtp_lr: float = 0.0  # the MTP layer kept trained on the rollouts (0: off)
    warmup_compile: bool = True  # compile every prefill and decode shape before the loop
    reward_shaping: str = "none"  # by task complexity (envs/reward.py): "none", "difficulty", "pass_rate"
    reward_alpha: float = 0.5
    # DAPO (arXiv 2503.14476): groups whose rewards are all equal are dropped and others
    # sampled in their place; answers within `overlong_buffer` tokens of the budget, or
    # cut at it, are penalised (0: off)
    dynamic_sampling: bool = False
    overlong_buffer: int = 0
    validate_every: int = 0  # greedy and sampled pass rates on validation tasks every N steps (0: off)
    validate_tasks: int = 64
    # the policy as a Hugging Face directory (workdir/export/step_N) every N steps (0: off);
    # the final one, workdir/export/final, is always written
    export_every: int = 0
    # with config.mesh: the engine in the learner's layout ("learner": publishing is a
    # reference swap) or the serving one ("decode": publishing reshards inside XLA)
    engine_rules: str = "learner"
    # the engine on devices of its own, after the learner's: their axis sizes, e.g.
    # "expert=2,tensor=2" ("": on the learner's devices)
    engine_mesh: str = ""
    # with several processes: an engine on each process's own devices ("process"), or one engine
    # over every device of the job ("job"; no process holds a whole model), which every
    # process steps in lockstep (rl/engine/lockstep.py)
    engine_span: str = "process"
    # engines over blocks of the learner's devices, each over rl.engine_mesh, behind one router
    # (rl/engine/groups.py); a group that stops, or holds requests without a step for
    # engine_stall_seconds, has its rollouts in flight dropped and is rebuilt. Blocks that span
    # processes are stepped by every process in lockstep (rl/engine/lockstep.py): there a group
    # whose step raises is rebuilt, and stalls are not watched
    engine_groups: int = 1
    engine_stall_seconds: float = 120.0
    # Training-inference mismatch on MoE routing (rl/learner.py): "measure" has the engine record
    # the experts it chose at every position and the job log how often the learner's routers
    # choose otherwise; "on" (R3, arXiv 2510.11370) also makes the learner run the engine's
    # experts; "off" does neither
    routing_replay: str = "off"
    # Importance correction of the engine/learner log-prob gap: "tis" weighs each action token by
    # min(pi_learner / pi_engine, correction_cap); "sequence_mask" drops the rollouts whose
    # geometric-mean ratio leaves [1 / correction_cap, correction_cap]; either makes the
    # algorithm's ratio pi_theta / pi_learner (decoupled); "none": pi_theta / pi_engine
    rollout_correction: str = "none"
    correction_cap: float = 2.0
    replay: ReplayConfig = ReplayConfig()
    compaction: CompactionConfig = CompactionConfig()

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"rl.algorithm={self.algorithm!r} is invalid: expected one of {tuple(ALGORITHMS)}")
        if self.group_size < 1 or self.batch_size < 1 or self.batch_size % self.group_size:
            raise ValueError(f"rl.batch_size={self.batch_size} must be a positive multiple of "
                             f"rl.group_size={self.group_size}")
        if self.group_size == 1 and ALGORITHMS[self.algorithm].groups:
            raise ValueError(f"rl.algorithm={self.algorithm!r} compares rollouts of one prompt: set rl.group_size >= 2")
        if self.dynamic_sampling and self.group_size == 1:
            raise ValueError("rl.dynamic_sampling drops groups whose rewards are all equal: set rl.group_size >= 2")
        _at_least("rl", self, 0, "eta", note=" (0 = synchronous)")
        _at_least("rl", self, 0, "kl_coef", "num_draft", "mtp_lr", "overlong_buffer", "validate_every",
                  "critic_warmup", "actor_warmup", "export_every", note=" (0 = off)")
        _at_least("rl", self, 1, "slots", "engine_groups")
        if self.engine_groups > 1 and not self.engine_mesh:
            raise ValueError(f"rl.engine_groups={self.engine_groups} needs rl.engine_mesh: each group's axis sizes, "
                             "e.g. expert=2,tensor=2 (the groups split the learner's devices)")
        if self.engine_span not in ("process", "job"):
            raise ValueError(f"rl.engine_span={self.engine_span!r} is invalid: expected 'process' (an engine per "
                             "process) or 'job' (one engine over every process's devices)")
        if self.engine_stall_seconds <= 0:
            raise ValueError(f"rl.engine_stall_seconds={self.engine_stall_seconds} is invalid: expected > 0")
        _at_least("rl", self, 0, "steps", "tau", "critic_steps")
        if self.temperature <= 0:
            raise ValueError(f"rl.temperature={self.temperature} is invalid: expected > 0")
        if self.reward_shaping not in SHAPINGS:
            raise ValueError(f"rl.reward_shaping={self.reward_shaping!r} is invalid: expected one of {SHAPINGS}")
        if self.engine_rules not in ("learner", "decode"):
            raise ValueError(f"rl.engine_rules={self.engine_rules!r} is invalid: expected 'decode' or 'learner'")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"rl.routing_replay={self.routing_replay!r} is invalid: expected one of {ROUTING_REPLAY}")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rl.rollout_correction={self.rollout_correction!r} is invalid: expected one of "
                             f"{ROLLOUT_CORRECTIONS}")
        if self.correction_cap <= 1:
            raise ValueError(f"rl.correction_cap={self.correction_cap} is invalid: expected > 1")

    @property
    def uses_critic(self) -> bool:
        return ALGORITHMS[self.algorithm].critic


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """`config.env`: the sandboxed episodes of an agentic job (envs/shell.py: ShellEnv)."""

    # threads running environment work (commands, verifiers), or with backend "ray" waiting on it
    workers: int = 4
    max_turns: int = 4
    turn_tokens: int = 40  # most tokens of one model turn
    command_seconds: float = 5.0
    episode_seconds: float = 60.0  # environment work of one rollout past this is abandoned
    observation_bytes: int = 256
    show_help: bool = False
    # envs/tool_calls.py; "auto": the chat template's tool-call format (GLM's or JSON), else "bash"
    action_format: str = "auto"
    # each episode's sandbox: memory and files together, its disk, cores for all its processes
    memory_mb: int = 2048
    disk_mb: int = 1024
    cpus: float = 1.0
    timing: bool = True  # seconds in each observation's status line
    # where episodes' sandboxes live (rl/tasks.py: ENV_BACKENDS): "thread", in this process;
    # "ray", each episode on one of `ray_workers` Ray actors (envs/workers/ray_backend.py) of
    # the cluster at `ray_address` ("": a private Ray on this machine; "auto": the one `ray
    # start` runs here; "host:port": a cluster's head, whose nodes run this installation),
    # each reserving `ray_worker_cpus` of its node and running `ray_worker_slots` calls at once
    backend: str = "thread"
    ray_address: str = ""
    ray_workers: int = 4
    ray_worker_cpus: float = 1.0
    ray_worker_slots: int = 8

    def __post_init__(self):
        from envs.tool_calls import parser
        from rl.tasks import ENV_BACKENDS

        _at_least("env", self, 1, "workers", "max_turns", "turn_tokens", "observation_bytes", "memory_mb", "disk_mb",
                  "ray_workers", "ray_worker_slots")
        if self.backend not in ENV_BACKENDS:
            raise ValueError(f"env.backend={self.backend!r} is unknown: expected one of {sorted(ENV_BACKENDS)}")
        if self.ray_worker_cpus < 0:
            raise ValueError(f"env.ray_worker_cpus={self.ray_worker_cpus} is invalid: expected >= 0")
        if self.command_seconds <= 0 or self.episode_seconds <= 0 or self.cpus <= 0:
            raise ValueError(f"env.command_seconds={self.command_seconds}, env.episode_seconds="
                             f"{self.episode_seconds} and env.cpus={self.cpus} must be > 0")
        if self.action_format != "auto":
            parser(self.action_format)  # names an unknown format


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """`config.eval`: the evaluation matrix on the final weights (envs/evaluate.py)."""

    matrix_tasks: int = 0  # held-out tasks in the matrix (0: no matrix)
    samples: int = 4  # episodes per task
    ks: str = "1,4"  # pass@k for each k

    def __post_init__(self):
        try:
            ks = self.k_values
        except ValueError:
            ks = ()
        if not ks or min(ks) < 1 or max(ks) > self.samples:
            raise ValueError(f"eval.ks={self.ks!r} is invalid: expected comma-separated k in 1..eval.samples="
                             f"{self.samples}")

    @property
    def k_values(self) -> list[int]:
        return [int(k) for k in str(self.ks).split(",") if k.strip()]


RUNTIME_FIELDS = ("dtype", "param_dtype", "kernel_impl", "moe_capacity_factor", "moe_chunk_tokens",
                  "scan_layers", "remat")


def _model(cfg, checkpoint: str = "") -> ModelConfig:
    """`config.model`; with a checkpoint, its config.json, with `config.model`'s runtime fields
    (how to run it: dtypes, kernels) over it."""
    if not checkpoint:
        if "model" not in cfg:
            raise ValueError("the config has no `model` section and no base.checkpoint: give one (a Hugging Face "
                             "directory: --config.base.checkpoint=DIR)")
        return presets.model_config_from(cfg)
    runtime = {k: v for k, v in _plain(cfg["model"] if "model" in cfg else None).items() if k in RUNTIME_FIELDS}
    try:
        return ModelConfig.from_hf(checkpoint, **runtime)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"base.checkpoint={checkpoint!r}: config.json: {err}") from None


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """The RL job's whole config (configs/sao_tiny.py, configs/sao_agent_tiny.py).

    `raw` keeps the ConfigDict for what reads it as it is: the placement sections (`mesh`,
    `rules`, `distributed`: glmjax/distributed.py) and what is written beside checkpoints."""

    model: ModelConfig
    task: TaskConfig
    base: BaseConfig
    rl: RLConfig
    env: EnvConfig | None  # agentic jobs only
    eval: EvalConfig
    distributed: distributed.DistributedConfig
    seed: int = 0
    checkpoint_every: int = 10
    raw: Any = dataclasses.field(default=None, compare=False, repr=False)

    SECTIONS = ("model", "task", "base", "rl", "env", "eval", "mesh", "rules", "distributed", "seed",
                "checkpoint_every")

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict | Mapping) -> JobConfig:
        unknown = sorted(set(cfg) - set(cls.SECTIONS))
        if unknown:
            raise ValueError(f"config has unknown section(s) {unknown}; the RL job reads {', '.join(cls.SECTIONS)}")
        task = build(TaskConfig, cfg["task"], "task")
        env = build(EnvConfig, cfg["env"], "env") if "env" in cfg and cfg["env"] is not None else None
        base = build(BaseConfig, cfg["base"], "base")
        job = cls(model=_model(cfg, base.checkpoint), task=task, base=base,
                  rl=build(RLConfig, cfg["rl"], "rl"), env=env,
                  eval=build(EvalConfig, cfg["eval"] if "eval" in cfg else None, "eval"),
                  distributed=distributed.DistributedConfig.of(cfg),
                  seed=cfg["seed"] if "seed" in cfg else 0,
                  checkpoint_every=cfg["checkpoint_every"] if "checkpoint_every" in cfg else 10, raw=cfg)
        job.check()
        return job

    @property
    def agentic(self) -> bool:
        return self.task.agentic

    @property
    def processes(self) -> int:
        return self.distributed.num_processes

    def check(self) -> None:
        """Raises ValueError naming the first field that the job cannot run across sections,
        so that a mistyped value stops the job before the base model trains."""
        from glmjax.chat import ByteChat

        model, task, rl = self.model, self.task, self.rl
        if self.agentic:
            if self.env is None:
                raise ValueError("an agentic job (sandboxed tasks) needs an `env` section: see "
                                 "configs/sao_agent_tiny.py")
            if not self.base.checkpoint and model.vocab_size < ByteChat.vocab_size:
                raise ValueError(f"model.vocab_size={model.vocab_size} has no room for the chat role tokens: "
                                 f"episodes need >= {ByteChat.vocab_size} (glmjax/chat.py)")
        if task.max_len > model.max_position_embeddings:
            raise ValueError(f"task.max_len={task.max_len} exceeds model.max_position_embeddings="
                             f"{model.max_position_embeddings}")
        if task.agent and not self.base.checkpoint:
            raise ValueError(f"task.agent={task.agent!r} talks to the engine through the chat template of a "
                             "checkpoint: give base.checkpoint (a Hugging Face directory with a tokenizer)")
        if self.base.checkpoint and rl.compaction.enabled:
            raise ValueError("rl.compaction writes its markers in the byte vocabulary: it runs without "
                             "base.checkpoint only")
        for key in ("num_draft", "mtp_lr"):
            if getattr(rl, key) and not model.num_nextn_predict_layers:
                raise ValueError(f"rl.{key}={getattr(rl, key)} needs an MTP layer: set "
                                 "model.num_nextn_predict_layers=1")
        if task.max_len + rl.num_draft > model.max_position_embeddings:
            raise ValueError(f"task.max_len={task.max_len} + rl.num_draft={rl.num_draft} exceeds "
                             f"model.max_position_embeddings={model.max_position_embeddings}: the engine's cache "
                             f"holds the drafts past the window")
        if rl.overlong_buffer > task.max_new_tokens:
            raise ValueError(f"rl.overlong_buffer={rl.overlong_buffer} exceeds task.max_new_tokens="
                             f"{task.max_new_tokens}, the budget it is counted back from")
        processes = self.processes
        if processes > 1 and rl.batch_size % (processes * rl.group_size):
            raise ValueError(f"rl.batch_size={rl.batch_size} must split over distributed.num_processes={processes} in "
                             f"whole groups of rl.group_size={rl.group_size}: make it a multiple of "
                             f"{processes * rl.group_size}")
        if processes != 1 and rl.replay.enabled:
            raise ValueError("rl.replay runs in one process: set rl.replay.enabled=False for a multi-process job")
        if rl.engine_mesh and processes != 1 and rl.engine_groups == 1:
            raise ValueError(f"rl.engine_mesh={rl.engine_mesh!r} puts the engine on devices of its own in one "
                             f"process; with distributed.num_processes={processes} each process runs an engine "
                             f"on its share of the learner's devices: leave rl.engine_mesh empty")
        distributed.check_job(self.raw)


# The distillation job (configs/opd_tiny.py, rl/distill/trainer.py) ------------------------
@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """One entry of `config.teachers`: a specialist, the student's base fine-tuned on one
    family; `steps` and `demonstrations` override `teacher_sft`'s for it."""

    family: str
    difficulty: int | None = 1
    steps: int | None = None
    demonstrations: int | None = None


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """`config.opd`: rounds of student rollouts scored by the teachers (rl/distill/)."""

    rounds: int = 80
    batches_per_round: int = 4
    epochs: int = 3  # passes over each round's rollouts
    batch_size: int = 32
    slots: int = 64
    temperature: float = 0.5
    kl_coef: float = 0.0  # the sampled reverse KL as an advantage
    outcome_weight: float = 0.0  # the verifier's reward, less its domain's batch mean, as an advantage
    distribution: str = "full"  # the distribution-level KL: "full", "topk", or "sampled" (none)
    topk: int = 16
    beta: float = 0.0  # D = beta KL(s || t) + (1 - beta) KL(t || s)
    dist_weight: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 4.0
    actor_lr: float = 1e-3
    warmup: int = 10
    grad_clip: float = 1.0
    prefetch: bool = True  # the next teacher loads while the student samples

    def __post_init__(self):
        from rl.distill.losses import DISTRIBUTIONS, Distillation

        if self.distribution not in (*DISTRIBUTIONS, "sampled"):
            raise ValueError(f"opd.distribution={self.distribution!r} is invalid: expected one of "
                             f"{(*DISTRIBUTIONS, 'sampled')}")
        if self.distribution != "sampled":
            Distillation(self.distribution, self.beta, self.dist_weight)  # names a bad beta
        _at_least("opd", self, 1, "rounds", "batches_per_round", "epochs", "batch_size", "slots", "topk")
        if self.temperature <= 0:
            raise ValueError(f"opd.temperature={self.temperature} is invalid: expected > 0")

    def learner(self) -> RLConfig:
        """The settings of the student's learner: SAO's loss on the caller's advantages."""
        return RLConfig(algorithm="sao", temperature=self.temperature, eps_low=self.eps_low, eps_high=self.eps_high,
                        actor_lr=self.actor_lr, grad_clip=self.grad_clip)

    def distillation(self):
        """The distribution-level term the learner adds (None for "sampled")."""
        from rl.distill.losses import Distillation

        if self.distribution == "sampled":
            return None
        return Distillation(self.distribution, self.beta, self.dist_weight)


@dataclasses.dataclass(frozen=True)
class DistillJobConfig:
    """The distillation job's whole config: the student's base (`student`), each teacher's
    fine-tuning (`teacher_sft`, `teachers`), the OPD rounds (`opd`)."""

    model: ModelConfig
    task: TaskConfig  # seed, train_tasks, eval_tasks, max_len, max_new_tokens (families: the teachers')
    student: BaseConfig
    teacher_sft: BaseConfig
    teachers: dict[str, TeacherConfig]
    opd: DistillConfig
    distributed: distributed.DistributedConfig
    seed: int = 0
    raw: Any = dataclasses.field(default=None, compare=False, repr=False)

    SECTIONS = ("model", "task", "student", "teacher_sft", "teachers", "opd", "mesh", "rules", "distributed", "seed")

    @classmethod
    def from_config(cls, cfg) -> DistillJobConfig:
        unknown = sorted(set(cfg) - set(cls.SECTIONS))
        if unknown:
            raise ValueError(f"config has unknown section(s) {unknown}; the distillation job reads "
                             f"{', '.join(cls.SECTIONS)}")
        teachers = {name: build(TeacherConfig, t, f"teachers.{name}") for name, t in _plain(cfg["teachers"]).items()}
        if not teachers:
            raise ValueError("config.teachers is empty: name at least one teacher (family=...)")
        student = build(BaseConfig, cfg["student"], "student")
        job = cls(model=_model(cfg, student.checkpoint), task=build(TaskConfig, cfg["task"], "task"), student=student,
                  teacher_sft=build(BaseConfig, cfg["teacher_sft"], "teacher_sft"), teachers=teachers,
                  opd=build(DistillConfig, cfg["opd"], "opd"), distributed=distributed.DistributedConfig.of(cfg),
                  seed=cfg["seed"] if "seed" in cfg else 0, raw=cfg)
        job.check()
        return job

    def teacher_sft_for(self, teacher: TeacherConfig) -> BaseConfig:
        """`teacher_sft` with the teacher's own step and demonstration budgets."""
        own = {k: getattr(teacher, k) for k in ("steps", "demonstrations") if getattr(teacher, k) is not None}
        return dataclasses.replace(self.teacher_sft, **own)

    def check(self) -> None:
        if self.teacher_sft.checkpoint or self.teacher_sft.critic_checkpoint or self.student.critic_checkpoint:
            raise ValueError("the distillation job starts from student.checkpoint: the teachers are fine-tuned "
                             "from it and there is no critic (teacher_sft.checkpoint and *.critic_checkpoint "
                             "stay empty)")
        if self.distributed.num_processes != 1:
            raise ValueError("the distillation job runs in one process (over any mesh of its devices): set "
                             "distributed.num_processes=1")
        distributed.check_job(self.raw)
        for name, t in sorted(self.teachers.items()):
            if t.family not in families.TEXT:
                raise ValueError(f"teachers.{name}.family={t.family!r} is not a text task family: expected one of "
                                 f"{sorted(families.TEXT)}")
        if self.task.max_len > self.model.max_position_embeddings:
            raise ValueError(f"task.max_len={self.task.max_len} exceeds model.max_position_embeddings="
                             f"{self.model.max_position_embeddings}")
