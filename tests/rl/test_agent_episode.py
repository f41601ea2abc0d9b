"""Episodes driven by an off-the-shelf agent through the engine's OpenAI API
(rl/agent_episode.py): the learner's row is, token for token, what the engine received and
produced, whatever the agent sends back."""

import threading

import pytest

import glmjax
from envs import families
from envs.agents import SHELL_TOOLS, terminus
from envs.sandbox.sandbox import Limits
from envs.shell import ShellEnv
from glmjax.chat import HFChat
from glmjax.tiny_checkpoint import make_checkpoint
from rl.agent_episode import AgentEpisode, AgentServer
from rl.engine.driver import Driver
from rl.engine.engine import GlmEngine

WINDOW = 383


class RecordingDriver(Driver):
    """A Driver that keeps every request it is given and its handle."""

    def __init__(self, engine):
        super().__init__(engine)
        self.submitted, self._lock = [], threading.Lock()

    def submit(self, request):
        handle = super().submit(request)
        with self._lock:
            self.submitted.append((request, handle))
        return handle


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = make_checkpoint(str(tmp_path_factory.mktemp("agent") / "model"), seed=1)
    chat = HFChat.from_pretrained(checkpoint, tools=list(SHELL_TOOLS))
    engine = GlmEngine(glmjax.from_pretrained(checkpoint), max_concurrent_decodes=4, max_len=WINDOW + 1)
    driver = RecordingDriver(engine).start()
    server = AgentServer(driver, chat, window=WINDOW)
    yield driver, server, chat
    server.close()
    driver.stop()


def _episode(server, agent, session_id, **kw):
    task = families.make_tasks("lookup", 1, seed=5, difficulty=1)[0]
    env = ShellEnv(limits=Limits(wall_seconds=5.0, memory_bytes=512 << 20), max_turns=6, show_help=False)
    args = dict(session_id=session_id, max_turns=4, turn_tokens=24, temperature=1.0, seed=11)
    return AgentEpisode(task, env, agent, server, **{**args, **kw})


def _run(episode):
    work = episode.next()
    work()
    assert episode.next() is None and episode.reward is not None
    episode.close()
    return episode.trajectories(rollout_id=0)


def _engine_spans(driver, row_tokens, since):
    """(start, tokens, result) of each engine request made since index `since`: where its
    output sits in the row; every request's prompt must be the row's prefix before it."""
    spans = []
    for request, handle in driver.submitted[since:]:
        result = handle.result(timeout=60)
        n = len(request.prompt)
        assert list(request.prompt) == row_tokens[:n], "an engine prompt is not the row's prefix"
        spans.append((n, list(result.tokens), result))
    return spans


def _recorded(served, agent, session_id):
    """An episode of `agent` run to the end; its row, the row's tokens and the engine
    requests made for it (`_engine_spans`)."""
    driver, server, _ = served
    since = len(driver.submitted)
    episode = _episode(server, agent, session_id)
    (row,) = _run(episode)
    tokens = row.prompt + row.completion
    return episode, row, tokens, _engine_spans(driver, tokens, since)


def test_the_row_is_exactly_what_the_engine_received_and_produced_over_several_turns(served):
    chat = served[2]
    episode, row, tokens, spans = _recorded(served, terminus, "exact-1")
    assert episode.turns >= 3 and len(episode.calls) == episode.turns
    assert len(spans) == len(episode.calls) >= 3
    action = [0] * len(tokens)
    for start, out, result in spans:
        assert tokens[start:start + len(out)] == out  # the engine's tokens, not a re-encoding
        p = len(row.prompt)
        assert row.log_probs[start - p:start - p + len(out)] == result.log_probs
        assert row.versions[start - p:start - p + len(out)] == result.versions
        for i in range(start, start + len(out)):
            action[i] = 1
    mask = row.observation_mask or [0] * len(row.completion)
    # every completion token is the engine's (mask 0) or an observation the server appended (mask 1)
    assert [1 - m for m in mask] == action[len(row.prompt):]
    assert sum(mask) > 0 and len(tokens) <= WINDOW
    # the first prompt is the template's rendering of the system-less task with the shell's tools
    first = episode.calls[0]
    assert first.prompt_ids == chat.encode_text(chat.tokenizer.apply_chat_template(
        first.messages, tools=list(SHELL_TOOLS), tokenize=False, add_generation_prompt=True))
    # a call is flagged exactly when the template's rendering of what the agent sent differs
    # from the engine's tokens (a sampled token sequence that BPE would encode otherwise)
    for call in episode.calls:
        rendered = chat.encode_text(chat.tokenizer.apply_chat_template(
            call.messages, tools=list(SHELL_TOOLS), tokenize=False, add_generation_prompt=True))
        assert call.rerendered == (rendered != call.prompt_ids)
    assert episode.info["rerendered"] == sum(c.rerendered for c in episode.calls)


def _editing_agent(client, model, instruction, shell, *, max_turns, max_tokens, temperature, seed):
    """An agent that rewrites its own past turn before sending the history back (as agents
    that re-render or summarise do)."""
    from envs.agents import AgentRun

    messages = [{"role": "user", "content": instruction}]
    run = AgentRun(messages=messages)
    for turn in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                               temperature=temperature, seed=seed)
        run.turns += 1
        messages.append({"role": "assistant", "content": (reply.choices[0].message.content or "") + " (edited)"})
        messages.append({"role": "user", "content": f"go on {turn}"})
    run.stopped = "max_turns"
    return run


def test_an_agent_that_rewrites_history_is_flagged_and_the_row_keeps_the_engines_tokens(served):
    episode, row, tokens, spans = _recorded(served, _editing_agent, "edit-1")
    assert episode.info["rerendered"] == 2  # the second and third calls carry an edited history
    assert [c.rerendered for c in episode.calls] == [False, True, True]
    for start, out, _ in spans:
        assert tokens[start:start + len(out)] == out


def test_the_models_commands_cannot_reach_the_server(served):
    """The episode's sandbox has no network: a command cannot call the API that records the
    episode (to write its own tokens) or anything else on the host."""
    _, server, _ = served
    task = families.make_tasks("lookup", 1, seed=5, difficulty=1)[0]
    env = ShellEnv(limits=Limits(wall_seconds=5.0), max_turns=3, show_help=False)
    env.reset(task)
    from envs.base import Action

    probe = (f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {server.api.port}), timeout=2); "
             "print('CONNECTED')\"")
    step = env.act(Action((probe,), False, None, True))
    env.close()
    assert "CONNECTED" not in step.observation and "[exit 0" not in step.observation


def test_the_rl_job_trains_on_agent_episodes(tmp_path, monkeypatch):
    """configs/sao_hf_agent.py with task.agent=terminus: the job serves its own engine to the
    agent, collects the sessions' rows and trains on them: the learner's rows hold the
    engine's tokens (log-probs recorded) between tool results out of the loss."""
    import json
    import os

    import numpy as np

    from rl import cli as rl_cli
    from rl.learner import Learner

    batches, step = [], Learner.step

    def recording(self, batch, **kw):
        batches.append(batch)
        return step(self, batch, **kw)

    monkeypatch.setattr(Learner, "step", recording)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    checkpoint = make_checkpoint(str(tmp_path / "model"), seed=2)
    workdir = str(tmp_path / "run")
    summary = rl_cli.run(["--config", f"{repo}/configs/sao_hf_agent.py:{checkpoint}", "--workdir", workdir,
                          "--config.task.agent=terminus", "--config.task.train_tasks=4", "--config.task.eval_tasks=2",
                          "--config.rl.steps=2", "--config.rl.batch_size=2", "--config.rl.slots=2",
                          "--config.rl.critic_warmup=0", "--config.env.max_turns=2", "--config.env.turn_tokens=16",
                          "--config.rl.warmup_compile=False", "--config.rl.export_every=0"])
    assert summary["steps"] == 2 and summary["rollouts"] == 4 and summary["dropped"] == {}
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"step"' in line]
    assert all(r["turns_per_episode"] >= 1 and "rerendered_calls_per_episode" in r for r in rows)
    assert len(batches) == 2
    for batch in batches:
        mask, logp = np.asarray(batch.action_mask), np.asarray(batch.logp_rollout)
        for m, lp in zip(mask, logp):
            acted = np.flatnonzero(m)
            assert len(acted) > 0 and np.all(lp[m == 0] == 0) and np.all(lp[acted] < 0)
            assert (m[acted[0]:acted[-1]] == 0).any()  # a tool result (or nudge) between two model turns
