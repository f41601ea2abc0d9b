"""ShellEnv: a multi-turn episode over a ``HarborTask`` in a ``Sandbox``.

    env = ShellEnv(max_turns=10)
    obs = env.reset(task)                 # instruction + the action format (envs/base.py)
    obs, reward, done, info = env.step('<bash>ls</bash>')
    obs, reward, done, info = env.step('<submit/>')   # tests run now; reward is final
    env.close()

``act(Action(...))`` takes an action already parsed (an agent's structured tool calls).

Actions are read in ``action_format`` (``envs/tool_calls.py``: ``"bash"`` tags or GLM's
``"glm"`` tool calls); ``finish()`` ends an episode whose agent ran out of budget. ``timing=False`` leaves the
seconds out of each command's status line (``[exit 0]``), so that the same commands
give the same observations.

The episode ends at ``<submit/>``, after ``max_turns`` actions, or when the task's agent
time (``HarborTask.agent_timeout``, summed over commands) is spent; the tests are copied
in and run only then. A multi-step task (``HarborTask.steps``) goes step by step: when a
step ends so (turns and agent time are per step) its tests run, and the next step's
instruction is the observation; the episode ends after the last step, or after a step
that scored below its ``min_reward``, with the task's ``trial_reward``
(``info["step_rewards"]`` has each step's). Each command runs under the sandbox limits, its wall clock capped
by the agent time left. Observations are capped at ``observation_bytes`` (head and tail
kept). ``noise`` (see ``envs/augment.py``) may perturb observations, never rewards. A task
whose environment cannot be set up raises ``UnsupportedTask`` from ``reset``; a sandbox
failure mid-episode ends the episode with reward 0 and ``info["error"]`` (a dropped
sample, not a dead loop).
"""

from __future__ import annotations

import random
from typing import Callable

from envs import tool_calls
from envs.base import ACTION_HELP, Action, Step, Transcript, Turn
from envs.harbor.task import (
    HarborTask,
    Verdict,
    prepare,
    run_tests,
    stops_after,
    task_env,
    task_sandbox,
    trial_reward,
)
from envs.sandbox.sandbox import Limits, Sandbox, SandboxError


def _describe(parsed: Action) -> str:
    return "".join(f"<bash>{c}</bash>" for c in parsed.commands) + (
        f"<submit>{parsed.answer}</submit>" if parsed.submit and parsed.answer else "<submit/>" if parsed.submit else "")


def clip(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    half = limit // 2
    return (data[:half].decode(errors="ignore") + f"\n[... {len(data) - limit} bytes cut ...]\n"
            + data[-half:].decode(errors="ignore"))


class ShellEnv:
    def __init__(self, *, limits: Limits = Limits(wall_seconds=20.0), max_turns: int = 16,
                 observation_bytes: int = 4096, network: str = "none", filesystem: str = "auto",
                 noise: Callable[[str, random.Random], str] | None = None, seed: int = 0, show_help: bool = True,
                 action_format: str = "bash", timing: bool = True):
        self.parse = tool_calls.parser(action_format)
        self.timing = timing
        self.limits, self.max_turns, self.observation_bytes = limits, max_turns, observation_bytes
        self.sandbox_args = {"network": network, "filesystem": filesystem}
        self.noise, self.rng, self.show_help = noise, random.Random(seed), show_help
        self.sandbox: Sandbox | None = None
        self.task: HarborTask | None = None
        self.transcript: Transcript | None = None
        self.verdict: Verdict | None = None

    def reset(self, task: HarborTask) -> str:
        self.close()
        if not isinstance(task, HarborTask):
            raise TypeError(f"ShellEnv runs HarborTask, got {type(task).__name__} ({getattr(task, 'id', '?')})")
        self.sandbox = task_sandbox(task, self.limits, **self.sandbox_args)
        try:
            prepare(self.sandbox, task)
        except BaseException:
            self.close()
            raise
        self.task, self.verdict, self.step_rewards = task, None, []
        self.stats = {"actions": 0, "parsed": 0, "commands": 0, "killed": 0}
        self.current = task.steps[0] if task.steps else task
        self.turns, self.time_left = 0, self.current.agent_timeout
        prompt = self.current.instruction.rstrip("\n") + ("\n\n" + ACTION_HELP if self.show_help else "") + "\n"
        self.transcript = Transcript(task.id, [Turn("prompt", prompt)])
        return prompt

    def step(self, action: str) -> Step:
        """The model's turn ``action``, read in the env's action format."""
        return self.act(self.parse(action), action)

    def act(self, parsed: Action, text: str | None = None) -> Step:
        """An action already parsed (an agent's structured tool calls); ``text`` is what the
        transcript keeps of it."""
        if self.task is None:
            raise RuntimeError("ShellEnv.step before reset (or after the episode ended)")
        self.turns += 1
        action = text if text is not None else _describe(parsed)
        self.transcript.add("model", action)
        self.stats["actions"] += 1
        self.stats["parsed"] += parsed.parsed
        parts = [] if parsed.parsed else [f"[no command run: {parsed.error}]"]
        try:
            for command in parsed.commands:
                if self.time_left <= 0:
                    parts.append("[agent time is up]")
                    break
                if "\0" in command:  # no argument of a process can hold one: the model's mistake, not the sandbox's
                    parts.append("[not run: the command holds a NUL byte]")
                    continue
                wall = max(min(self.sandbox.limits.wall_seconds, self.time_left), 0.1)
                limits = self.sandbox.limits.replace(wall_seconds=wall)
                result = self.sandbox.run(self.sandbox.rewrite(command), limits=limits,
                                          env=task_env(self.sandbox, self.task))
                self.time_left -= result.seconds
                self.stats["commands"] += 1
                self.stats["killed"] += result.killed is not None
                parts.append(f"{result.output}{'' if result.output.endswith(chr(10)) or not result.output else chr(10)}"
                             f"{result.summary(self.timing)}")
        except SandboxError as err:
            return self._finish(0.0, {"error": str(err)})
        observation = clip("\n".join(parts), self.observation_bytes) + "\n"
        if self.noise is not None:
            observation = self.noise(observation, self.rng)
        self.transcript.add("tool", observation)
        if parsed.submit or self.turns >= self.max_turns or self.time_left <= 0:
            if self.task.steps:
                return self._end_step({"answer": parsed.answer, "submitted": parsed.submit}, observation)
            return self._finish(None, {"answer": parsed.answer, "submitted": parsed.submit}, observation)
        return Step(observation, 0.0, False, {"parsed": parsed.parsed})

    def finish(self) -> Step:
        """Ends the episode now (the agent's token or time budget is spent): the tests run
        on the working directory as it is."""
        if self.task is None:
            raise RuntimeError("ShellEnv.finish before reset (or after the episode ended)")
        if not self.task.steps:
            return self._finish(None, {"submitted": False})
        try:  # the current step's tests; the steps not reached count as theirs would
            self.step_rewards.append(run_tests(self.sandbox, self.current).reward)
        except SandboxError as err:
            return self._finish(0.0, {"error": str(err)})
        return self._finish(trial_reward(self.task, self.step_rewards), {"submitted": False})

    def _end_step(self, info: dict, observation: str) -> Step:
        """A multi-step task's step is over: its tests run; the next step's instruction is
        the observation, unless this was the last step or scored below its ``min_reward``."""
        try:
            self.verdict = run_tests(self.sandbox, self.current)
        except SandboxError as err:
            return self._finish(0.0, {"error": str(err)}, observation)
        self.step_rewards.append(self.verdict.reward)
        info.update(step=self.current.id, step_reward=self.verdict.reward, reward_source=self.verdict.source)
        index = len(self.step_rewards)
        if index == len(self.task.steps) or stops_after(self.current, self.verdict.reward):
            return self._finish(trial_reward(self.task, self.step_rewards), info, observation)
        self.current = self.task.steps[index]
        self.turns, self.time_left = 0, self.current.agent_timeout
        text = f"[step {index + 1} of {len(self.task.steps)}]\n{self.current.instruction.rstrip()}\n"
        self.transcript.add("prompt", text)
        return Step(observation + text, 0.0, False, info)

    def _finish(self, reward: float | None, info: dict, observation: str = "") -> Step:
        if reward is None:
            try:
                self.verdict = run_tests(self.sandbox, self.task)
                reward = self.verdict.reward
                info["reward_source"] = self.verdict.source
            except SandboxError as err:
                reward, info["error"] = 0.0, str(err)
        if self.task.steps:
            info["step_rewards"] = list(self.step_rewards)
        info.update(self.stats, turns=self.turns)
        self.transcript.reward, self.transcript.info = reward, info
        self.task = None
        return Step(observation, reward, True, info)

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
        self.task = None
