"""The SAO post-training job in one process: rollouts and learning side by side.

    glmjax-train --config configs/sao_tiny.py --workdir /tmp/sao              # one-turn answers
    glmjax-train --config configs/sao_agent_tiny.py --workdir /tmp/agent      # multi-turn episodes

  1. base model (rl/base_model.py): supervised training on demonstrations (oracle
     answers, or oracle episodes: the demonstration's commands and the observations they
     really print, the observations not in the loss), cached in workdir/base, so a second
     run starts from it;
  2. held-out evaluation of the base (greedy);
  3. SAO: the engine's driver generates in a background thread from the WeightStore's
     newest weights; the collector (rl/collector.py) admits rollouts (staleness eta),
     runs their environment work in a worker pool, scores them and drops those older
     than tau versions; each batch of B trains one learner step, published to the
     WeightStore by reference;
  4. held-out evaluation again; workdir/summary.json and a before/after table.
The loop does not know what kind of rollout it runs (rl/rollout.py: one-turn answers,
compacted answers, episodes; rl/tasks.py makes them). Metrics go to tensorboardX
(workdir/tb), workdir/metrics.jsonl and a progress bar.

Checkpoints (workdir/checkpoints, rl/checkpoint.py) are written every
`checkpoint_every` steps; a rerun in the same workdir resumes from the newest one that
reads and prints "resumed from step N". The checkpoint carries the run's totals (rollouts,
dropped rollouts, learner, loop, warm-up and wall seconds), so a resumed run's
summary.json counts the whole run: every process's work up to its last checkpoint, and
the work after it, which the resumed run redoes, once.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import time

import jax
import numpy as np
from flax import nnx

from envs import evaluate as evaluate_matrix
from envs import families
from envs.base import is_full
from envs.reward import RewardConfig
from envs.reward import reward as shape
from glmjax import distributed, sharding
from rl import rollout as ro
from rl import tasks as rl_tasks
from rl.base_model import build_base
from glmjax.chat import ByteChat
from rl.checkpoint import LoopCheckpointer
from rl.collector import Collector, drive
from rl.compaction import Compaction
from rl.engine.driver import Driver
from rl.engine.engine import GlmEngine
from rl.env_client import EngineClient
from rl.job_log import JobLog, QuietLog
from rl.learner import ALGORITHMS, Learner, ValueModel
from rl.replay import BatchReplay
from rl.engine.weights import WeightStore

log = logging.getLogger(__name__)
STOP = rl_tasks.STOP


_compaction = rl_tasks.compaction


def _prefill_buckets(engine: GlmEngine, tasks, compaction: Compaction | None) -> tuple[int, ...]:
    """The prefill lengths a job uses: up to its longest prompt's bucket; with compaction
    or episodes every bucket (a continuation holds a summary or a history of any length)."""
    if compaction or not all(hasattr(t, "prompt") for t in tasks):
        return engine.buckets
    longest = engine.bucket(max(len(ro.encode(t.prompt)) for t in tasks))
    return tuple(b for b in engine.buckets if b <= longest)


def evaluate_rollouts(driver: Driver, rollouts, workers: int = 4) -> dict:
    """Runs rollouts to the end (rl/collector.py: drive) and returns the pass rate (full
    reward; a rollout without one fails), turns per episode and the seconds spent."""
    start = time.time()
    drive(driver, rollouts, workers=workers)
    rewards = [r.reward if r.reward is not None else 0.0 for r in rollouts]
    turns = [r.turns for r in rollouts if hasattr(r, "turns")]
    return {"pass_rate": float(np.mean([is_full(x) for x in rewards])), "reward": float(np.mean(rewards)),
            "turns": float(np.mean(turns)) if turns else 1.0, "seconds": time.time() - start,
            "failed": sum(r.reward is None for r in rollouts)}


def evaluate(driver: Driver, tasks, max_new_tokens: int, compaction: Compaction | None = None) -> float:
    """Greedy pass rate of one-turn tasks (compacting, as in training, when configured)."""
    window = driver.engine.max_len - driver.engine.num_draft - 1  # what the engine serves per request
    rollouts = []
    for i, t in enumerate(tasks):
        prompt = ro.encode(t.prompt)
        inner = rl_tasks.Rollout(prompt, rl_tasks.budget(prompt, max_new_tokens, window, compaction),
                                 compaction=compaction, stop_ids=STOP, session_id=f"eval-{i}" if compaction else None)
        rollouts.append(ro.TextRollout(t, inner))
    return evaluate_rollouts(driver, rollouts)["pass_rate"]


def _env_setting(cfg, name: str, default):
    """`cfg.env.<name>`; one-turn jobs have no `env` section and take `default`."""
    return cfg.env[name] if "env" in cfg else default


def _evaluate(cfg, driver: Driver, tasks, greedy: bool = True, **kw) -> dict:
    """evaluate_rollouts over `tasks`; with several processes each runs every count-th task
    on its own engine and the results are pooled."""
    make = rl_tasks.RolloutFactory(cfg, driver.engine.max_len - driver.engine.num_draft - 1, greedy=greedy, **kw)
    index, count = jax.process_index(), jax.process_count()
    mine = [make(t, i, session="eval") for i, t in enumerate(tasks) if i % count == index]
    result = evaluate_rollouts(driver, mine, workers=_env_setting(cfg, "workers", 4))
    if count == 1:
        return result
    parts = distributed.gather_objects((len(mine), result))
    n = max(sum(k for k, _ in parts), 1)
    pooled = {key: sum(k * r[key] for k, r in parts) / n for key in ("pass_rate", "reward", "turns")}
    return dict(pooled, seconds=max(r["seconds"] for _, r in parts), failed=sum(r["failed"] for _, r in parts))


def _matrix(cfg, engine: GlmEngine, heldout, workdir: str) -> dict:
    """The evaluation matrix (envs/evaluate.py, as `glmjax-envs eval` runs it) on the final
    weights through the engine client, the held-out tasks as its terminal category:
    pass@k with bootstrap intervals, sampled at the RL temperature. Written to
    workdir/eval_matrix.json."""
    e, m = cfg.env, cfg.eval
    driver = Driver(engine).start()
    try:
        report = evaluate_matrix.evaluate(
            EngineClient(driver, chat=ByteChat()), categories=["terminal"], tasks={"terminal": heldout[:m.matrix_tasks]},
            samples=m.samples, ks=[int(k) for k in str(m.ks).split(",")], model=os.path.join(workdir, "checkpoints"),
            workers=engine.max_concurrent_decodes, max_turns=e.max_turns, max_tokens=e.turn_tokens,
            temperature=cfg.rl.temperature, show_help=e.show_help, timing=e.get("timing", True),
            limits=rl_tasks.sandbox_limits(cfg))
    finally:
        driver.stop()
    with open(os.path.join(workdir, "eval_matrix.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


class TaskStream:
    """Training tasks in a seeded, shuffled, repeating order (grain), checkpointable. With
    `shard=(index, count)`, every count-th of them from the index-th: one process's share."""

    def __init__(self, tasks, seed: int, shard: tuple[int, int] = (0, 1)):
        import grain

        self.tasks = tasks
        index, count = shard
        self._ds = grain.MapDataset.range(len(tasks)).shuffle(seed=seed).repeat()[index::count]
        self._it = iter(self._ds.to_iter_dataset())

    def __next__(self):
        return self.tasks[next(self._it)]

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state):
        self._it.set_state(state)


def check_config(cfg) -> None:
    """Raises ValueError naming the first field of an RL config that the job cannot run, so
    that a mistyped value stops the job before the base model trains rather than after."""
    rl, task = cfg.rl, cfg.task
    if task.get("harbor_dir"):
        if not os.path.isdir(task.harbor_dir):
            raise ValueError(f"task.harbor_dir={task.harbor_dir!r} is not a directory")
    elif task.family not in families.TEXT and task.family not in families.SANDBOX:
        raise ValueError(f"task.family={task.family!r} is unknown: expected a text family {sorted(families.TEXT)} "
                         f"or a sandboxed one {sorted(families.SANDBOX)} (or task.harbor_dir=DIR)")
    if rl_tasks.agentic(cfg):
        if "env" not in cfg:
            raise ValueError("an agentic job (sandboxed tasks) needs an `env` section: see configs/sao_agent_tiny.py")
        if cfg.model.vocab_size < ByteChat.vocab_size:
            raise ValueError(f"model.vocab_size={cfg.model.vocab_size} has no room for the chat role tokens: "
                             f"episodes need >= {ByteChat.vocab_size} (glmjax/chat.py)")
        from envs.tool_calls import parser

        parser(cfg.env.action_format)
    bad = {k.strip() for k in (task.get("augment") or "").split(",") if k.strip()} - {"distractor", "reorder"}
    if bad:
        raise ValueError(f"task.augment={task.augment!r} names {sorted(bad)}: expected distractor and/or reorder")
    if task.difficulty is not None and not 1 <= task.difficulty <= 5:
        raise ValueError(f"task.difficulty={task.difficulty!r} is invalid: expected 1..5, or None for all")
    if task.max_len > cfg.model.max_position_embeddings:
        raise ValueError(f"task.max_len={task.max_len} exceeds model.max_position_embeddings="
                         f"{cfg.model.max_position_embeddings}")
    if rl.algorithm not in ALGORITHMS:
        raise ValueError(f"rl.algorithm={rl.algorithm!r} is invalid: expected one of {ALGORITHMS}")
    group = rl.get("group_size", 1)
    if group < 1 or rl.batch_size < 1 or rl.batch_size % group:
        raise ValueError(f"rl.batch_size={rl.batch_size} must be a positive multiple of rl.group_size={group}")
    if group == 1 and rl.algorithm in ("grpo", "dapo", "gspo"):
        raise ValueError(f"rl.algorithm={rl.algorithm!r} compares rollouts of one prompt: set rl.group_size >= 2")
    if rl.get("kl_coef", 0.0) < 0:
        raise ValueError(f"rl.kl_coef={rl.kl_coef} is invalid: expected >= 0 (0 = off)")
    if rl.eta < 0:
        raise ValueError(f"rl.eta={rl.eta} is invalid: expected >= 0 (0 = synchronous)")
    if rl.slots < 1:
        raise ValueError(f"rl.slots={rl.slots} is invalid: expected >= 1")
    mtp_layers = cfg.model.get("num_nextn_predict_layers", 0)
    for key in ("num_draft", "mtp_lr"):
        value = rl.get(key, 0)
        if value < 0:
            raise ValueError(f"rl.{key}={value} is invalid: expected >= 0 (0 = off)")
        if value and not mtp_layers:
            raise ValueError(f"rl.{key}={value} needs an MTP layer: set model.num_nextn_predict_layers=1")
    if task.max_len + rl.get("num_draft", 0) > cfg.model.max_position_embeddings:
        raise ValueError(f"task.max_len={task.max_len} + rl.num_draft={rl.num_draft} exceeds "
                         f"model.max_position_embeddings={cfg.model.max_position_embeddings}: the engine's cache "
                         f"holds the drafts past the window")
    RewardConfig(shaping=rl.get("reward_shaping", "none"), alpha=rl.get("reward_alpha", 0.5))  # names a bad value
    _compaction(cfg)  # Compaction validates its own fields
    if rl.get("engine_rules", "learner") not in ENGINE_RULES:
        raise ValueError(f"rl.engine_rules={rl.engine_rules!r} is invalid: expected one of {sorted(ENGINE_RULES)}")
    processes = (cfg.get("distributed") or {}).get("num_processes", 1)
    if processes > 1 and rl.batch_size % (processes * group):
        raise ValueError(f"rl.batch_size={rl.batch_size} must split over distributed.num_processes={processes} in "
                         f"whole groups of rl.group_size={group}: make it a multiple of {processes * group}")
    if processes != 1 and (rl.get("replay") or {}).get("enabled", False):
        raise ValueError("rl.replay runs in one process: set rl.replay.enabled=False for a multi-process job")
    if rl.get("engine_mesh", ""):
        _engine_devices(cfg)
        if processes != 1:
            raise ValueError(f"rl.engine_mesh={rl.engine_mesh!r} puts the engine on devices of its own in one "
                             f"process; with distributed.num_processes={processes} each process runs an engine "
                             f"on its share of the learner's devices: leave rl.engine_mesh empty")
    distributed.check_job(cfg)


def _scorer(cfg):
    """The reward the learner sees: the verifier's, or shaped by task complexity
    (`rl.reward_shaping`: envs/reward.py; "pass_rate" tracks each difficulty level's
    running pass rate over this run's rollouts)."""
    shaping = cfg.rl.get("reward_shaping", "none")
    if shaping == "none":
        return None
    config = RewardConfig(shaping=shaping, alpha=cfg.rl.get("reward_alpha", 0.5))
    seen = collections.defaultdict(lambda: [0, 0])  # difficulty -> [full rewards, rollouts]

    def score(task, r):
        passed, n = seen[task.difficulty]
        shaped = shape(r.reward, task, config, pass_rate=passed / n if n else 0.5)
        seen[task.difficulty][0] += is_full(r.reward)
        seen[task.difficulty][1] += 1
        return shaped

    return score


def _learn(learner: Learner, batch, cfg, rows: int, replay: BatchReplay | None) -> dict:
    """One learner step on a batch (GRPO: rows of one prompt share a group id; padding
    and replayed rows are groups of their own), with `replay.rows` stored rows beside the
    fresh ones when replay is on (rl/replay.py: BatchReplay)."""
    group = cfg.rl.get("group_size", 1)
    extra = replay.rows if replay else 0
    group_ids = None
    if group > 1:
        names = [tr.rollout_id // group for tr in batch] + [-1 - i for i in range(rows + extra - len(batch))]
        group_ids = np.unique(names, return_inverse=True)[1]
    arrays = ro.to_batch(batch, length=cfg.task.max_len, rows=rows + extra)
    if replay is None:
        return learner.step(arrays, group_ids=group_ids)
    arrays, weights, drawn = replay.fill(arrays, fresh=rows)
    metrics = learner.step(arrays, group_ids=group_ids, row_weights=weights)
    replay.update(arrays, learner.last_advantages, fresh=rows, drawn=drawn)
    return dict(metrics, replay_size=float(len(replay.buffer)), replay_rows=float(drawn is not None) * extra)


def run(cfg, workdir: str, make_rollout=None) -> dict:
    """The job (module docstring). `make_rollout(task, rollout_id)` -> a rollout
    (rl/rollout.py) replaces the default (rl/tasks.py: the task's prompt or episode, the
    config's sampling), e.g. for benchmarks that fix the generation lengths.

    With `config.mesh` (glmjax/distributed.py) policy and critic are created or loaded
    sharded by `config.rules`, learner batches are global arrays, and the engine decodes on
    the same devices: in the learner's layout (`rl.engine_rules="learner"`: publishing is a
    reference swap) or in the serving one ("decode": sharding.DECODE_RULES, publishing
    reshards inside XLA)."""
    check_config(cfg)
    os.makedirs(workdir, exist_ok=True)
    mesh, rules = distributed.job_mesh(cfg)
    if mesh is None:
        return _run(cfg, workdir, make_rollout, None)
    with sharding.use_mesh(mesh, rules):
        return _run(cfg, workdir, make_rollout, mesh)


# The engine's layout on the learner's mesh: the learner's own rules, or the serving ones.
ENGINE_RULES = {"learner": None, "decode": sharding.DECODE_RULES}


def _engine(cfg, policy, mesh) -> GlmEngine:
    """The rollout engine and its WeightStore, in the layout `rl.engine_rules` names: on the
    learner's devices (this process's share of them), or with `rl.engine_mesh` on as many
    devices of their own."""
    rl = cfg.rl
    drafts = rl.get("num_draft", 0)  # MTP speculation: drafts per step from the policy's own MTP layer
    # a step verifies `drafts` tokens past the last one kept: the cache has room for them
    max_len = cfg.task.max_len + drafts
    own = engine_mesh(cfg, mesh)
    if mesh is None and own is None:
        return GlmEngine(policy, weights=WeightStore(nnx.state(policy)), max_concurrent_decodes=rl.slots,
                         max_len=max_len, num_draft=drafts)
    rules = ENGINE_RULES[rl.get("engine_rules", "learner")] or sharding.current_rules()
    where = own if own is not None else distributed.local_mesh(mesh)  # several processes: each its own devices
    state = nnx.state(policy)
    store = WeightStore(state, shardings=sharding.param_shardings(state, where, rules))
    return GlmEngine(policy, weights=store, max_concurrent_decodes=rl.slots, max_len=max_len, mesh=where,
                     rules=rules, num_draft=drafts)


def engine_mesh(cfg, mesh):
    """The engine's own mesh when `rl.engine_mesh` gives one ("expert=2,tensor=2"), None
    when it decodes on the learner's devices: the devices that follow the learner's (devices
    4-7 after a learner on 0-3), as many as the learner has, so that publishing copies each
    parameter shard device to device (rl/engine/weights.py)."""
    if not cfg.rl.get("engine_mesh", ""):
        return None
    learner = mesh.size if mesh is not None else 1
    return sharding.make_mesh(**_engine_devices(cfg), devices=jax.devices()[learner:2 * learner])


def _engine_devices(cfg) -> dict[str, int]:
    """`rl.engine_mesh`'s axis sizes; a ValueError when they do not fit beside the learner's."""
    text = cfg.rl.engine_mesh
    sizes = sharding.parse_axes(text)
    learner, wanted = distributed.mesh_devices(cfg), math.prod(sizes.values())
    if wanted != learner:
        raise ValueError(f"rl.engine_mesh={text!r} spans {wanted} devices and config.mesh {learner}: give the "
                         f"engine as many devices as the learner (axis sizes that multiply to {learner})")
    if 2 * learner > len(jax.devices()):
        raise ValueError(f"rl.engine_mesh={text!r} needs {wanted} devices after the learner's {learner}; "
                         f"{len(jax.devices())} are available: shrink config.mesh and rl.engine_mesh together")
    return sizes


def _say(text: str) -> None:
    """A line of the job's output (process 0's)."""
    if distributed.is_main():
        print(text, flush=True)


def _gathered(collector: Collector, local: list) -> dict:
    """This step's share of every process: the batch in rollout order (as one process's
    collector would take it), the turns of the episodes finished since the last step, and
    the collectors' environment and rollout seconds and dropped rollouts so far."""
    finished = [r.turns for _, r in collector.drain_finished() if hasattr(r, "turns")]
    parts = distributed.gather_objects((local, finished, collector.env_seconds, collector.rollout_seconds,
                                        dict(collector.dropped)))
    return {"batch": sorted((tr for p in parts for tr in p[0]), key=lambda tr: (tr.rollout_id, tr.segment_index)),
            "turns": [t for p in parts for t in p[1]], "env_seconds": sum(p[2] for p in parts),
            "rollout_seconds": sum(p[3] for p in parts),
            "dropped": sum((collections.Counter(p[4]) for p in parts), collections.Counter())}


def _run(cfg, workdir: str, make_rollout, mesh) -> dict:
    start = time.time()
    rl = cfg.rl
    processes = jax.process_count()
    train_tasks, heldout, excluded = rl_tasks.task_sets(cfg, workdir)
    validation = rl_tasks.validation_tasks(cfg, train_tasks, heldout)
    policy = build_base(cfg, workdir, demo_tasks=train_tasks, mesh=mesh)
    critic = ValueModel(nnx.clone(policy)) if rl.algorithm in ("sao", "ppo") else None
    if critic is not None and mesh is not None:  # its head, made on one device, joins the mesh
        critic = sharding.shard_model(critic, mesh)
    learner = Learner(policy, critic, dict(rl), mesh=mesh)
    engine = _engine(cfg, policy, mesh)
    store = engine.weights
    disjoint = bool(rl.get("engine_mesh", ""))
    if mesh is not None or disjoint:
        where = distributed.describe(mesh) if mesh is not None else "one device"
        engines = "the engine"
        if disjoint:
            ids = [d.id for d in engine.mesh.devices.flat]
            engines = f"the engine on devices {ids[0]}-{ids[-1]} ({distributed.describe(engine.mesh)})"
        elif processes > 1:
            where = f"{where} over {processes} processes"
            engines = f"one engine per process on its {engine.mesh.size} devices"
        _say(f"policy and critic on {where}; {engines} in the {rl.get('engine_rules', 'learner')} layout")
    driver = Driver(engine)
    compaction = _compaction(cfg)
    warmup_start = time.time()  # every prefill shape now, so that no rollout waits for a compile mid-run
    if rl.get("warmup_compile", True):
        engine.warmup(buckets=_prefill_buckets(engine, train_tasks + heldout, compaction))
    warmup_seconds = time.time() - warmup_start
    shard = (jax.process_index(), processes)  # each process collects its share of every batch
    share = rl.batch_size // processes
    if share * processes != rl.batch_size or share % rl.get("group_size", 1):
        raise ValueError(f"rl.batch_size={rl.batch_size} does not split over {processes} processes in whole groups")
    stream = TaskStream(train_tasks, seed=cfg.task.seed, shard=shard)
    admission = ro.Admission(share, rl.eta, rl.slots)
    ckpt = LoopCheckpointer(os.path.join(workdir, "checkpoints"), keep=2)
    resumed = ckpt.restore(policy=policy, critic=critic, learner=learner, stream=stream, admission=admission)
    if resumed:
        _say(f"resumed from step {resumed['step']} ({os.path.join(ckpt.directory, str(resumed['step']))})")
        if resumed["version"] > store.version:  # a run killed before its first update stays at 0
            store.publish(nnx.state(policy), resumed["version"])
    before = resumed or {}  # the totals of the processes before this one, up to the checkpoint
    earlier = {k: before.get(k, 0.0) for k in ("wall_seconds", "warmup_seconds", "rl_seconds", "env_seconds")}
    logs = JobLog(workdir, rl.steps, learner.steps) if distributed.is_main() else QuietLog()

    base = resumed["base_eval"] if resumed and "base_eval" in resumed else _evaluate(cfg, driver, heldout)
    _say(f"base model: held-out pass rate {base['pass_rate']:.1%} on {len(heldout)} tasks")
    if not resumed:
        logs.eval(base, 0)

    window = cfg.task.max_len - 1
    make = make_rollout or rl_tasks.RolloutFactory(cfg, window)
    group = rl.get("group_size", 1)  # GRPO-style baselines sample G rollouts per prompt
    collector = Collector(driver, admission, make, stream, group_size=group, tau=rl.tau,
                          workers=_env_setting(cfg, "workers", 2), shard=shard,
                          env_timeout=_env_setting(cfg, "episode_seconds", 600.0), score=_scorer(cfg))
    driver.start()
    loop_start = time.time()
    step, rollouts = learner.steps, before.get("rollouts", 0)
    shared = {"env_seconds": 0.0, "rollout_seconds": 0.0, "dropped": collections.Counter()}
    dropped = collections.Counter(before.get("dropped", {}))
    yields = rl.get("generation_yields", True)
    rows = rl.batch_size * (compaction.max_segments if compaction else 1)  # one learner shape
    busy, last_step_at = before.get("learner_seconds", 0.0), time.time()
    drafted = (0, 0)  # the driver's accepted drafts and busy slot-steps at the last learner step
    replay_cfg = dict(rl.get("replay") or {})
    replay_on = replay_cfg.pop("enabled", False)
    replay = BatchReplay(**replay_cfg, seed=cfg.seed) if replay_on else None
    while step < rl.steps:
        collector.poll(store.version)
        local = collector.take(share)
        if local is None:
            driver.resume()
            time.sleep(0.002)
            continue
        if yields and collector.ready_rollouts() >= share:
            driver.pause()  # the next batch is complete too: generation waits while this one trains
        else:
            driver.resume()
        shared = _gathered(collector, local)
        batch = shared["batch"]
        t0 = time.time()
        metrics = _learn(learner, batch, cfg, rows, replay)
        store.publish(nnx.state(policy))
        learner_s = time.time() - t0
        busy += learner_s
        last = [tr for tr in batch if tr.finish_reason != "compacted"]  # one row per rollout
        step, rollouts = step + 1, rollouts + len(last)
        staleness = [tr.staleness(store.version - 1) for tr in batch]
        if compaction:
            metrics["segments_per_rollout"] = len(batch) / len(last)
        if shared["turns"]:
            metrics["turns_per_episode"] = float(np.mean(shared["turns"]))
        now = time.time()
        if engine.num_draft:  # drafts accepted per decode step since the last learner step
            counts = driver.stats["accepted_drafts"], driver.stats["busy_slot_steps"]
            metrics["mtp_accept_len"] = (counts[0] - drafted[0]) / max(counts[1] - drafted[1], 1)
            drafted = counts
        metrics["tokens_per_s"] = sum(len(tr.completion) for tr in batch) / max(now - last_step_at, 1e-9)
        last_step_at = now
        loop_s = earlier["rl_seconds"] + now - loop_start
        if last[0].raw_reward is not None:
            metrics["reward_raw"] = float(np.mean([tr.raw_reward for tr in last]))
        metrics.update(reward=float(np.mean([tr.reward for tr in last])), staleness_mean=float(np.mean(staleness)),
                       learner_s=learner_s, learner_busy_fraction=busy / max(loop_s, 1e-9),
                       env_seconds_per_rollout=(earlier["env_seconds"] + shared["env_seconds"]) / max(rollouts, 1))
        every = rl.get("validate_every", 0)
        if every and step % every == 0 and validation:
            driver.pause()  # validation has the machine: the training driver waits between steps
            for name, greedy in (("greedy", True), ("sampled", False)):
                result = _evaluate(cfg, Driver(engine), validation, greedy=greedy)
                logs.eval({f"validation_{name}_pass_rate": result["pass_rate"]}, step)
                metrics[f"validation_{name}_pass_rate"] = result["pass_rate"]
            driver.resume()
        logs.step(step, {"version": store.version, "time": now - start, "tasks": [tr.task_id for tr in last]},
                  metrics, staleness)
        if step % cfg.checkpoint_every == 0 or step == rl.steps:
            now = time.time()
            ckpt.save(step, policy=policy, critic=critic, learner=learner, stream=stream, admission=admission,
                      version=store.version, base_pass_rate=base["pass_rate"], base_eval=base, rollouts=rollouts,
                      dropped=dict(dropped + shared["dropped"]), learner_seconds=busy,
                      rl_seconds=earlier["rl_seconds"] + now - loop_start,
                      env_seconds=earlier["env_seconds"] + shared["env_seconds"],
                      warmup_seconds=earlier["warmup_seconds"] + warmup_seconds,
                      wall_seconds=earlier["wall_seconds"] + now - start)
    rl_seconds = max(earlier["rl_seconds"] + time.time() - loop_start, 1e-9)
    env_seconds = earlier["env_seconds"] + shared["env_seconds"]
    collector.close()
    driver.stop()
    ckpt.wait()

    # the training engine (compiled once) serves the final weights, the store's newest
    final = _evaluate(cfg, Driver(engine), heldout)
    logs.eval(final, step)
    summary = {"base_pass_rate": base["pass_rate"], "final_pass_rate": final["pass_rate"], "steps": step,
               "rollouts": rollouts, "algorithm": rl.algorithm, "eta": rl.eta,
               "dropped": dict(dropped + shared["dropped"]),
               "heldout_tasks": len(heldout), "train_tasks": len(train_tasks), "excluded_tasks": excluded,
               "wall_seconds": earlier["wall_seconds"] + time.time() - start,
               "warmup_seconds": earlier["warmup_seconds"] + warmup_seconds, "rl_seconds": rl_seconds,
               "learner_busy_fraction": busy / rl_seconds,
               "relative_gain": (final["pass_rate"] - base["pass_rate"]) / max(base["pass_rate"], 1e-9),
               "resumed_from_step": resumed["step"] if resumed else None, "processes": processes}
    if engine.num_draft:  # over this process's training rollouts
        summary.update(num_draft=engine.num_draft,
                       mtp_accept_len=driver.stats["accepted_drafts"] / max(driver.stats["busy_slot_steps"], 1))
    if rl_tasks.agentic(cfg):  # the same policy with every command's output hidden: what reading is worth
        blind = _evaluate(cfg, Driver(engine), heldout, blank_observations=True)
        summary.update(final_pass_rate_blind=blind["pass_rate"])
        summary.update(base_turns_per_episode=base["turns"], final_turns_per_episode=final["turns"],
                       env_seconds=env_seconds,
                       env_time_fraction=shared["env_seconds"] / max(shared["rollout_seconds"], 1e-9))
    if distributed.is_main():
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if rl_tasks.agentic(cfg) and cfg.get("eval", {}).get("matrix_tasks", 0):
            report = _matrix(cfg, engine, heldout, workdir)  # process 0's engine alone: no collective
            print(evaluate_matrix.table(report), flush=True)
    logs.close()
    _say(format_table(summary))
    return summary


def format_table(s: dict) -> str:
    rows = [("held-out pass rate", f"{s['base_pass_rate']:.1%}", f"{s['final_pass_rate']:.1%}"),
            ("change", "", f"{100 * (s['final_pass_rate'] - s['base_pass_rate']):+.1f} points "
                           f"({s['relative_gain']:+.0%})")]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'base':>10}  {'after ' + s['algorithm'].upper():>12}"]
    lines += [f"{a:{width}}  {b:>10}  {c:>12}" for a, b, c in rows]
    lines.append(f"{s['steps']} steps, {s['rollouts']} rollouts, {s['wall_seconds']:.0f} s")
    return "\n".join(lines)
