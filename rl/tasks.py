"""The RL job's tasks and how each becomes a rollout.

    train, heldout, excluded = task_sets(job, workdir)   # job: rl/config.py's JobConfig
    make = RolloutFactory(job, window)          # make(task, rollout_id) -> rl.rollout.Rollout
    stream = TaskStream(train, seed=job.task.seed)  # next(stream): the next training task

Four sources, by config:
- a text family (`task.family="sorting"`): one-turn `TextTask`s, a `TextRollout` each;
- a JSONL prompt dataset (`task.data=FILE.jsonl` or a directory of them, envs/datasets.py):
  one-turn tasks with the row's verifier; rows held out by their `split` field, or
  `task.heldout_fraction` of the rest by a hash;
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
not check again. Held-out tasks come from another seed (`task.seed + 1`). Episodes take
their environments from `env.backend`'s pool (`make_env`, `ENV_BACKENDS`): ShellEnvs in
this process, or each episode's sandbox on a Ray worker; the three checks run here.

The job's chat format (`job_chat`): the byte vocabulary (`ByteChat`; one-turn prompts are
the prompt's bytes, answers end at a newline), or with `base.checkpoint` the checkpoint's
tokenizer and chat template (`HFChat`; one-turn prompts are a user turn, answers end at
the template's stop tokens, and episodes call the shell as the template's tools).
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import random
import threading

from tqdm.auto import tqdm

from envs import augment, families, tool_calls
from envs.agents import AGENTS, SHELL_TOOLS
from envs.base import parse_action
from envs.harbor import validate
from envs.harbor.task import HarborTask
from envs.sandbox.sandbox import Limits
from envs.shell import ShellEnv
from envs.workers import InProcess, RayWorkers, RemoteEnv
from glmjax import distributed, storage
from glmjax.chat import ByteChat, HFChat
from rl import rollout as ro
from rl.compaction import Answer, Compaction
from rl.engine.driver import Request, Result
from rl.episode import Episode

log = logging.getLogger(__name__)
STOP = ro.encode("\n")

def job_chat(cfg):
    """The job's chat format (module docstring)."""
    return chat_for(cfg.base.checkpoint, cfg.agentic)


@functools.lru_cache(maxsize=8)
def chat_for(checkpoint: str, agentic: bool = False):
    """ByteChat without a checkpoint; the checkpoint's HFChat (the shell's tools listed when
    `agentic`) with one."""
    if not checkpoint:
        return ByteChat()
    return HFChat.from_pretrained(checkpoint, tools=list(SHELL_TOOLS) if agentic else None)


def action_format(cfg) -> str:
    """`env.action_format`, "auto" resolved: the template's tool-call format, or "bash"."""
    name = cfg.env.action_format
    if name != "auto":
        return name
    chat = job_chat(cfg)
    template = getattr(getattr(chat, "tokenizer", None), "chat_template", None)
    try:
        return tool_calls.style_of(template) if template else "bash"
    except ValueError:  # a template without tool calls: the model writes <bash> tags in its text
        return "bash"


def prompt_tokens(chat, task) -> list[int]:
    """A one-turn task's prompt: its bytes, or a user turn (its messages) in the template."""
    if isinstance(chat, ByteChat):
        return ro.encode(task.prompt)
    messages = getattr(task, "messages", None)
    if messages:
        return chat.encode_text(chat.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                                   add_generation_prompt=True))
    return chat.start(task.prompt)


def answer_stops(chat) -> tuple[int, ...]:
    """What ends a one-turn answer: a newline in bytes, the template's stop tokens otherwise."""
    return tuple(STOP) if isinstance(chat, ByteChat) else chat.stop_ids


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
    if t.data:
        from envs import datasets

        train, heldout = datasets.split(datasets.load_tasks(storage.fetched(t.data)), t.heldout_fraction, seed=t.seed)
        if not train or not heldout:
            raise ValueError(f"task.data={t.data!r} splits into {len(train)} training and {len(heldout)} held-out "
                             "tasks: each needs one (mark rows \"split\": \"heldout\" or raise task.heldout_fraction)")
        train, refused = _augmented(cfg, train[:t.train_tasks])
        return train, heldout[:t.eval_tasks], {"augment_refused": refused} if refused else {}
    if not agentic(cfg):
        train = families.make_tasks(t.family, t.train_tasks, seed=t.seed, difficulty=t.difficulty)
        heldout = families.make_tasks(t.family, t.eval_tasks, seed=t.seed + 1, split="heldout", difficulty=t.difficulty)
        train, refused = _augmented(cfg, train)
        return train, heldout, {"augment_refused": refused} if refused else {}
    if t.harbor_dir:
        from envs.harbor import dirs as harbor_dirs

        tasks = harbor_dirs.load_tasks([storage.fetched(t.harbor_dir)])
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
    if t.harbor_dir or t.data:
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
    if path and storage.exists(path):
        for line in storage.read_text(path).splitlines():
            try:
                row = json.loads(line)
                status[row["task"]] = row["status"]
            except (ValueError, KeyError):  # a line cut short by a kill: checked again
                continue
    todo = list({x.id: x for x in tasks if x.id not in status}.values())
    if todo:
        out = storage.AppendLog(path) if path else None
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


# env.backend: where episodes' environments run (envs/workers), each built from the env section
ENV_BACKENDS = {
    "thread": lambda e: InProcess(),
    "ray": lambda e: RayWorkers(e.ray_workers, address=e.ray_address, cpus=e.ray_worker_cpus,
                                slots=e.ray_worker_slots),
}


_POOLS: dict = {}  # env section -> its pool
_POOLS_LOCK = threading.Lock()  # the first calls come from the environment threads at once


def env_workers(e) -> InProcess | RayWorkers:
    """The pool of `env.backend` for the env section `e`: one per process, shared by the
    job's rollouts, evaluations and demonstrations (Ray's workers end with the process, or
    at `close_env_workers`)."""
    with _POOLS_LOCK:
        if e not in _POOLS:
            _POOLS[e] = ENV_BACKENDS[e.backend](e)
        return _POOLS[e]


def close_env_workers() -> None:
    """Ends every pool `env_workers` made (and a Ray that one of them started)."""
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()


def make_env(cfg, action_format_: str | None = None) -> ShellEnv | RemoteEnv:
    """One episode's environment: a ShellEnv here, or with env.backend="ray" one with its
    interface whose sandbox lives on a Ray worker (envs/workers/ray_backend.py)."""
    e = cfg.env
    return env_workers(e).env(limits=sandbox_limits(cfg), max_turns=e.max_turns, observation_bytes=e.observation_bytes,
                              show_help=e.show_help, action_format=action_format_ or action_format(cfg),
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
    every command's output from the model). With `task.agent`, sandboxed tasks are
    `AgentEpisode`s whose agent calls the engine through an OpenAI-compatible server over
    `driver` (rl/agent_episode.py), started on first use and stopped by `close()`."""

    def __init__(self, cfg, window: int, *, greedy: bool = False, blank_observations: bool = False, driver=None):
        self.cfg, self.window, self.greedy, self.blank = cfg, window, greedy, blank_observations
        self.compaction = compaction(cfg)
        self.chat = job_chat(cfg)
        self.seed = cfg.seed * 1_000_003
        self.driver, self._server = driver, None

    def server(self):
        from rl.agent_episode import AgentServer

        if self._server is None:
            if self.driver is None:
                raise ValueError("task.agent episodes need the engine's driver: RolloutFactory(..., driver=driver)")
            self._server = AgentServer(self.driver, self.chat, self.window)
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def __call__(self, task, rid: int, session: str = "rollout"):
        cfg = self.cfg
        temperature = 0.0 if self.greedy else cfg.rl.temperature
        if isinstance(task, HarborTask) and cfg.task.agent:
            from rl.agent_episode import AgentEpisode

            e = cfg.env
            return AgentEpisode(task, make_env(cfg, "bash"), AGENTS[cfg.task.agent], self.server(),
                                session_id=f"{session}-{rid}-{self.seed + rid}", max_turns=e.max_turns,
                                turn_tokens=e.turn_tokens, temperature=temperature, seed=self.seed + rid,
                                seconds=e.episode_seconds or None, blank_observations=self.blank)
        if isinstance(task, HarborTask):
            e = cfg.env
            return Episode(task, make_env(cfg), self.chat, turn_tokens=e.turn_tokens, window=self.window,
                           temperature=temperature, seed=self.seed + rid, session_id=f"{session}-{rid}",
                           seconds=e.episode_seconds or None,
                           compaction=self.compaction, blank_observations=self.blank)
        prompt = prompt_tokens(self.chat, task)
        c = self.compaction
        inner = Answer(prompt, budget(prompt, cfg.task.max_new_tokens, self.window, c), compaction=c,
                       stop_ids=answer_stops(self.chat), temperature=temperature, seed=self.seed + rid,
                       session_id=f"{session}-{rid}" if c else None, decode=self.chat.decode)
        return ro.TextRollout(task, inner)


def oracle_episode(task: HarborTask, env, chat, window: int, style: str = "bash") -> Episode:
    """The episode a model would have if it wrote the task's demonstration
    (`metadata["demonstration"]`, one action per turn; else the solution as one command),
    with the observations its commands really print: the supervised demonstrations, in
    exactly the layout RL produces. Raises ValueError when the demonstration is not
    rewarded. `style`: the action format the env reads (the demonstration is restated in it)."""
    actions = list(task.metadata.get("demonstration") or [f"<bash>{_body(task.solution)}</bash><submit/>"])
    episode = Episode(task, env, chat, turn_tokens=window, window=window, min_turn_tokens=1)
    turns = iter(actions)
    while (work := episode.next()) is not None:
        if isinstance(work, Request):
            text = restate(next(turns, "<submit/>"), style)
            written = chat.assistant(text) if hasattr(chat, "assistant") else chat.encode_text(text)
            tokens = (written + [chat.tool_call_id])[:work.max_new_tokens]
            episode.receive(Result(tokens, [0.0] * len(tokens), [0] * len(tokens), "stop"))
        else:
            work()
    if episode.reward is None or episode.reward < 1.0 - 1e-6:
        raise ValueError(f"the demonstration of task {task.id} scores {episode.reward} "
                         f"({episode.finish_reason}, {episode.info}): {actions}")
    return episode


def restate(action: str, style: str) -> str:
    """A demonstration's action (``<bash>...</bash>`` tags and ``<submit/>``) in the action
    format ``style`` reads: GLM's XML tool calls or JSON ones."""
    if style == "bash":
        return action
    parsed = parse_action(action)
    calls = [("bash", {"command": c}) for c in parsed.commands]
    if parsed.submit:
        calls.append(("submit", {"answer": parsed.answer} if parsed.answer else {}))
    if style == "glm":
        return "".join(f"<tool_call>{name}" + "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>"
                                                      for k, v in args.items()) + "\n</tool_call>"
                       for name, args in calls)
    if style == "json":
        return "".join(f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>" for name, args in calls)
    raise ValueError(f"no way to restate a demonstration in action format {style!r}")


def _body(script: str | None) -> str:
    lines = (script or "").splitlines()
    return "\n".join(lines[1:] if lines and lines[0].startswith("#!") else lines).strip()
