"""The RL job's tasks and how each becomes a rollout.

    train, heldout, excluded = task_sets(job, workdir)   # job: rl/config.py's JobConfig
    make = RolloutFactory(job, window)          # make(task, rollout_id) -> rl.rollout.Rollout
    stream = TaskStream(train, seed=job.task.seed)  # next(stream): the next training task

Three sources, by config:
- a text family (`task.family="sorting"`): one-turn `TextTask`s, a `TextRollout` each;
- a sandboxed family (`task.family="lookup"`, `"terminal"` ...): generated `HarborTask`s,
  each run as a multi-turn `Episode` in a `ShellEnv`;
- a directory of Harbor tasks (`task.harbor_dir=DIR`): the same, from disk; one task in
  ten (by a hash of its content, `envs.families.split_of`) is held out.
With `task.augment` ("distractor", "reorder" or both, comma-separated), a fraction
`task.augment_fraction` of the training tasks gets an adversarially perturbed copy
(envs/augment.py: an irrelevant fact, operands in another order) that keeps the verified
answer; a copy whose oracle stops scoring is refused and counted. Sandboxed tasks train
only once their verifier has passed the three checks (oracle
rewarded, no-op not, unfinished not: `envs/harbor/validate.py`); the others are excluded and
counted by status. Reports are cached in workdir/validation.jsonl, so a resumed run does
not check again. Held-out tasks come from another seed (`task.seed + 1`).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random

from tqdm.auto import tqdm

from envs import augment, families
from envs.harbor import validate
from envs.harbor.task import HarborTask
from envs.sandbox.sandbox import Limits
from envs.shell import ShellEnv
from glmjax import distributed
from glmjax.chat import ByteChat
from rl import rollout as ro
from rl.compaction import Answer, Compaction
from rl.engine.driver import Request, Result
from rl.episode import Episode

log = logging.getLogger(__name__)
STOP = ro.encode("\n")


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


def agentic(cfg) -> bool:
    """Whether the job runs multi-turn episodes (sandboxed tasks) rather than one-turn answers."""
    return cfg.task.agentic


def task_sets(cfg, workdir: str | None = None) -> tuple[list, list, dict]:
    """(train, held-out, excluded by cause) of the config's task source."""
    t = cfg.task
    if not agentic(cfg):
        train = families.make_tasks(t.family, t.train_tasks, seed=t.seed, difficulty=t.difficulty)
        heldout = families.make_tasks(t.family, t.eval_tasks, seed=t.seed + 1, split="heldout", difficulty=t.difficulty)
        train, refused = _augmented(cfg, train)
        return train, heldout, {"augment_refused": refused} if refused else {}
    if t.harbor_dir:
        from envs.harbor import dirs as harbor_dirs

        tasks = harbor_dirs.load_tasks([t.harbor_dir])
        if not tasks:
            raise ValueError(f"task.harbor_dir={t.harbor_dir!r} holds no Harbor task directories")
        heldout = [x for x in tasks if families.split_of(x) == "heldout"]
        train = [x for x in tasks if families.split_of(x) == "train"]
        if not heldout or not train:  # too few tasks to split: evaluate on the training tasks
            log.warning("task.harbor_dir has %d tasks: too few to hold one in ten out; evaluating on all", len(tasks))
            train = heldout = tasks
        train, heldout = train[:t.train_tasks], heldout[:t.eval_tasks]
    else:
        train = families.make_tasks(t.family, t.train_tasks, seed=t.seed, difficulty=t.difficulty)
        heldout = families.make_tasks(t.family, t.eval_tasks, seed=t.seed + 1, split="heldout", difficulty=t.difficulty)
    train, refused = _augmented(cfg, train)
    # process 0 runs the checks (and keeps their cache); every process takes its statuses
    checked = _validated(train + heldout, workdir, workers=cfg.env.workers) if distributed.is_main() else None
    status = distributed.gather_objects(checked)[0]
    excluded = collections.Counter({"augment_refused": refused} if refused else {})
    excluded += collections.Counter(status[x.id] for x in train + heldout if status[x.id] != "pass")
    kept = lambda tasks: [x for x in tasks if status[x.id] == "pass"]  # noqa: E731
    if not kept(train) or not kept(heldout):
        raise ValueError(f"no {'training' if not kept(train) else 'held-out'} task passed the three checks "
                         f"(excluded by status: {dict(excluded)}); see {workdir}/validation.jsonl")
    return kept(train), kept(heldout), dict(excluded)


def validation_tasks(cfg, train: list, heldout: list) -> list:
    """`rl.validate_tasks` tasks for periodic validation during training, from another seed
    (`task.seed + 2`) and neither training nor held-out tasks: a run that picks its policy
    by validation does not pick it on the held-out tasks."""
    n = cfg.rl.validate_tasks
    if not n or not cfg.rl.validate_every:
        return []
    t, taken = cfg.task, {x.id for x in train + heldout}
    if t.harbor_dir:
        return train[:n]  # a directory has no other seed: its training tasks, as a training-curve check
    pool = families.make_tasks(t.family, 2 * n, seed=t.seed + 2, difficulty=t.difficulty)
    fresh = [x for x in pool if x.id not in taken][:n]
    if agentic(cfg):
        status = _validated(fresh, None, workers=cfg.env.workers)
        fresh = [x for x in fresh if status[x.id] == "pass"]
    return fresh


def _augmented(cfg, tasks: list) -> tuple[list, int]:
    """The tasks and, for `task.augment_fraction` of them, a perturbed copy (module
    docstring); the number of copies refused because the perturbation broke the task."""
    kinds = cfg.task.augment_kinds
    if not kinds:
        return tasks, 0
    rng = random.Random(f"augment:{cfg.task.seed}")
    out, refused = list(tasks), 0
    for task in tasks:
        if rng.random() < cfg.task.augment_fraction:
            try:
                out.append(augment.augment(task, kinds, rng))
            except (ValueError, TypeError) as err:
                log.debug("augmentation of %s refused: %s", task.id, err)
                refused += 1
    return out, refused


def _validated(tasks: list[HarborTask], workdir: str | None, workers: int) -> dict[str, str]:
    """task id -> validation status, checking only the tasks not in the cache."""
    path = os.path.join(workdir, "validation.jsonl") if workdir else None
    status = {}
    if path and os.path.exists(path):
        for line in open(path):
            try:
                row = json.loads(line)
                status[row["task"]] = row["status"]
            except (ValueError, KeyError):  # a line cut short by a kill: checked again
                continue
    todo = list({x.id: x for x in tasks if x.id not in status}.values())
    if todo:
        out = open(path, "a") if path else None
        bar = tqdm(validate.iter_validate(todo, workers=workers, limits=Limits(wall_seconds=30.0)), total=len(todo),
                   desc="three checks", mininterval=1.0)
        for report in bar:
            status[report.task_id] = report.status
            if out:
                out.write(json.dumps({"task": report.task_id, "status": report.status, "reason": report.reason}) + "\n")
                out.flush()
        if out:
            out.close()
    return status


def sandbox_limits(cfg) -> Limits:
    """Each command's limits in the job's sandboxes: the env section's ``command_seconds``,
    ``memory_mb``, ``disk_mb`` and ``cpus``."""
    e = cfg.env
    return Limits(wall_seconds=e.command_seconds, memory_bytes=e.memory_mb << 20, disk_bytes=e.disk_mb << 20,
                  cpus=e.cpus)


def make_env(cfg) -> ShellEnv:
    e = cfg.env
    return ShellEnv(limits=sandbox_limits(cfg), max_turns=e.max_turns,
                    observation_bytes=e.observation_bytes, show_help=e.show_help, action_format=e.action_format,
                    timing=e.timing)


def compaction(cfg) -> Compaction | None:
    # the engine serves max_len - 1 tokens: it keeps one cache entry for the step's write
    return Compaction.from_config(cfg.rl.compaction, window=cfg.task.max_len - 1)


def budget(prompt, max_new_tokens: int, window: int, compaction: Compaction | None) -> int:
    """Answer tokens a one-turn rollout may write: without compaction, what the window leaves."""
    return max_new_tokens if compaction else max(1, min(max_new_tokens, window - len(prompt)))


class RolloutFactory:
    """`make(task, rollout_id)`: the rollout the task's kind needs, sampling as configured
    (`greedy=True` for evaluation; `blank_observations` for the ablation that hides
    every command's output from the model)."""

    def __init__(self, cfg, window: int, *, greedy: bool = False, blank_observations: bool = False):
        self.cfg, self.window, self.greedy, self.blank = cfg, window, greedy, blank_observations
        self.compaction = compaction(cfg)
        self.chat = ByteChat()
        self.seed = cfg.seed * 1_000_003

    def __call__(self, task, rid: int, session: str = "rollout"):
        cfg = self.cfg
        temperature = 0.0 if self.greedy else cfg.rl.temperature
        if isinstance(task, HarborTask):
            e = cfg.env
            return Episode(task, make_env(cfg), self.chat, turn_tokens=e.turn_tokens, window=self.window,
                           temperature=temperature, seed=self.seed + rid, session_id=f"{session}-{rid}",
                           seconds=e.episode_seconds or None,
                           compaction=self.compaction, blank_observations=self.blank)
        prompt = ro.encode(task.prompt)
        c = self.compaction
        inner = Answer(prompt, budget(prompt, cfg.task.max_new_tokens, self.window, c), compaction=c, stop_ids=STOP,
                        temperature=temperature, seed=self.seed + rid, session_id=f"{session}-{rid}" if c else None)
        return ro.TextRollout(task, inner)


def oracle_episode(task: HarborTask, env, chat, window: int) -> Episode:
    """The episode a model would have if it wrote the task's demonstration
    (`metadata["demonstration"]`, one action per turn; else the solution as one command),
    with the observations its commands really print: the supervised demonstrations, in
    exactly the layout RL produces. Raises ValueError when the demonstration is not
    rewarded."""
    actions = list(task.metadata.get("demonstration") or [f"<bash>{_body(task.solution)}</bash><submit/>"])
    episode = Episode(task, env, chat, turn_tokens=window, window=window, min_turn_tokens=1)
    turns = iter(actions)
    while (work := episode.next()) is not None:
        if isinstance(work, Request):
            tokens = (chat.encode_text(next(turns, "<submit/>")) + [chat.tool_call_id])[:work.max_new_tokens]
            episode.receive(Result(tokens, [0.0] * len(tokens), [0] * len(tokens), "stop"))
        else:
            work()
    if episode.reward is None or episode.reward < 1.0 - 1e-6:
        raise ValueError(f"the demonstration of task {task.id} scores {episode.reward} "
                         f"({episode.finish_reason}, {episode.info}): {actions}")
    return episode


def _body(script: str | None) -> str:
    lines = (script or "").splitlines()
    return "\n".join(lines[1:] if lines and lines[0].startswith("#!") else lines).strip()
