"""Episodes driven by an off-the-shelf agent through the engine's OpenAI-compatible API.

    server = AgentServer(driver, chat, window=job.task.max_len - 1)    # 127.0.0.1, a random token
    episode = AgentEpisode(task, env, AGENTS["terminus"], server, session_id="rollout-7", ...)
    # the collector runs episode.next() (one piece of environment work: the whole agent loop)
    rows = episode.trajectories(rollout_id=7)

The agent (envs/agents) knows only a base URL, a key, the task's instruction and the shell
as tools; it calls `/v1/chat/completions` as it would call any provider. The base URL
names the episode's session (rl/engine/sessions.py), so the server records each call's
prompt tokens as sent to the engine, the completion tokens as the engine produced them,
their log-probs and weight versions; within the session every prompt is the previous
prompt and completion followed by the tokens of the new messages (tool results, a user
nudge), so the calls chain into one row:

    row        = calls[0].prompt_ids | calls[0].completion_ids | new_1 | calls[1].completion_ids | ...
    mask       =         (prompt)    |           0...0         | 1..1  |           0...0          | ...
    log-probs  =                     |   the engine's          |  0    |   the engine's           |

and the learner trains on exactly the engine's tokens. When the agent sends back a history
whose tokens differ from the engine's (it edited or re-rendered a past turn), the server
marks the call `rerendered` and still continues from the engine's tokens; the episode counts
such calls in `info["rerendered"]`. A call the server refused (the conversation outgrew the
window) ends the agent's loop; the verifier then scores the sandbox as it is.

The agent's commands run in the episode's sandbox, which has no network: nothing the model
runs can reach the server (or anything else on the host).
"""

from __future__ import annotations

import secrets
import threading
import time

from envs.base import Action
from rl.rollout import Trajectory


class AgentServer:
    """The engine's OpenAI-compatible API over `driver` for agent episodes: loopback only,
    with a random bearer token, serving at most `window` tokens per session. The driver is
    stepped by its owner (the RL loop's thread, or `drive`); the server only submits."""

    def __init__(self, driver, chat, window: int, model_name: str = "policy"):
        from rl.engine.openai_api import OpenAIServer

        self.token = secrets.token_urlsafe(24)
        self.model_name = model_name
        self.api = OpenAIServer(driver, chat.tokenizer, model_name, auth_token=self.token, max_len=window + 1,
                                stop_ids=chat.stop_ids, start_driver=False).start("127.0.0.1", 0)

    def client(self, session_id: str, timeout: float):
        import openai

        return openai.OpenAI(base_url=self.api.session_url(session_id), api_key=self.token, max_retries=0,
                             timeout=timeout)

    def close(self) -> None:
        self.api.stop()


class _Shell:
    """The env as the agent's tools (envs/agents: Shell); `blank` hides every command's
    output (the ablation of what reading is worth)."""

    def __init__(self, env, blank: bool = False):
        self.env, self.blank, self.done, self.last = env, blank, False, None
        self.lock = threading.Lock()  # an agent that calls tools from threads still runs them one at a time

    def bash(self, command: str) -> str:
        return self._act(Action((command,), False, None, True))

    def submit(self, answer: str | None) -> str:
        return self._act(Action((), True, answer, True))

    def _act(self, action: Action) -> str:
        with self.lock:
            if self.done:
                return "[the episode is over]"
            step = self.env.act(action)
            self.done, self.last = step.done, step
            return "" if self.blank else step.observation


class AgentEpisode:
    """One episode of `agent` on `task` in `env` through `server` (module docstring); a
    rollout of rl/rollout.py whose only work is environment work."""

    def __init__(self, task, env, agent, server: AgentServer, *, session_id: str, max_turns: int, turn_tokens: int,
                 temperature: float, seed: int, seconds: float | None = None, blank_observations: bool = False):
        self.task, self.env, self.agent, self.server = task, env, agent, server
        self.blank = blank_observations
        self.session_id, self.max_turns, self.turn_tokens = session_id, max_turns, turn_tokens
        self.temperature, self.seed, self.seconds = temperature, seed, seconds
        self.reward: float | None = None
        self.finish_reason: str | None = None
        self.info: dict = {}
        self.turns = 0
        self.calls: list = []
        self.env_seconds = 0.0
        self._ran = False

    def next(self):
        return None if self._ran else self._run

    def receive(self, result) -> None:
        raise RuntimeError("an agent episode asks the engine through its server, not through the collector")

    def _run(self) -> None:
        start = time.time()
        self._ran = True
        try:
            instruction = self.env.reset(self.task)
            shell = _Shell(self.env, self.blank)
            client = self.server.client(self.session_id, timeout=self.seconds or 600.0)
            try:
                run = self.agent(client, self.server.model_name, instruction, shell, max_turns=self.max_turns,
                                 max_tokens=self.turn_tokens, temperature=self.temperature, seed=self.seed)
            finally:
                self.calls = [c for c in self.server.api.sessions.close(self.session_id)
                              if c.finish_reason not in ("cancelled", "error")]
            step = shell.last if shell.done else self.env.finish()
            self.reward, self.info = float(step.reward), dict(step.info)
            self.turns = run.turns
            self.finish_reason = "error" if "error" in step.info else {"refused": "length"}.get(run.stopped, "stop")
            self.info.update(agent_stopped=run.stopped, rerendered=sum(c.rerendered for c in self.calls))
            if not self.calls:
                raise RuntimeError(f"the agent made no model call ({run.stopped}: {run.error})")
        finally:
            self.env_seconds += time.time() - start

    def trajectories(self, rollout_id: int, **meta) -> list[Trajectory]:
        """The session's calls as one row (module docstring)."""
        prompt = list(self.calls[0].prompt_ids)
        row, log_probs, versions, mask = [], [], [], []
        for i, call in enumerate(self.calls):
            so_far = prompt + row
            if list(call.prompt_ids[:len(so_far)]) != so_far:
                raise ValueError(f"session {self.session_id}: call {i}'s prompt does not continue the engine's "
                                 "tokens of the calls before it")
            new = list(call.prompt_ids[len(so_far):])
            version = versions[-1] if versions else (call.versions[0] if call.versions else 0)
            row += new + list(call.completion_ids)
            log_probs += [0.0] * len(new) + list(call.logprobs)
            versions += [version] * len(new) + list(call.versions)
            mask += [1] * len(new) + [0] * len(call.completion_ids)
        return [Trajectory(prompt, row, log_probs, versions, self.reward, rollout_id=rollout_id,
                           observation_mask=mask if any(mask) else None, finish_reason=self.finish_reason, **meta)]

    def close(self) -> None:
        self.env.close()
