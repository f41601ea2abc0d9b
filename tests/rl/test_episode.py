"""Multi-turn episodes in the RL loop: token in / token out, prefix reuse across turns,
observations out of the policy loss, environments off the generation path, chat formats."""

import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glmjax
from envs import families
from envs.base import Step
from envs.shell import ShellEnv
from envs.tool_calls import parse_tool_call
from glmjax import chat as chat_module
from glmjax.chat import ByteChat, HFChat, Turn
from rl import rollout as ro
from rl import sao
from rl.collector import Collector, drive
from rl.config import RLConfig
from rl.engine.driver import Driver
from rl.engine.engine import GlmEngine
from rl.episode import Episode
from rl.learner import Learner, ValueModel, token_logprobs
from tests.engine_util import TINY

CHAT = ByteChat()
CONFIG = dataclasses.replace(TINY, vocab_size=ByteChat.vocab_size)


@pytest.fixture(scope="module")
def model():
    return glmjax.init_model(CONFIG, seed=3)


class Recording(Driver):
    """A driver that keeps every request it was given and every result it returned."""

    def __init__(self, engine):
        super().__init__(engine)
        self.seen = []

    def submit(self, request, handle=None):
        handle = super().submit(request, handle)
        self.seen.append(handle)
        return handle


def test_learner_row_is_token_for_token_what_the_engine_saw_over_three_turns(model):
    task = families.make_tasks("lookup", 1, seed=4, difficulty=2)[0]
    driver = Recording(GlmEngine(model, max_concurrent_decodes=2, max_len=256))
    episode = Episode(task, ShellEnv(show_help=False, max_turns=3), CHAT, turn_tokens=24, window=250,
                      temperature=1.0, seed=11, session_id="ep-0")
    drive(driver, [episode])
    assert episode.turns == 3 and episode.reward == 0.0 and episode.finish_reason == "stop", episode.info
    (row,) = episode.trajectories(rollout_id=0)
    whole = row.prompt + row.completion
    assert len(driver.seen) == 3
    at = len(row.prompt)
    for turn, handle in enumerate(driver.seen):
        req, res = handle.request, handle.result()
        assert list(req.prompt) == whole[:len(req.prompt)], turn  # each turn's prompt is the row so far
        assert len(req.prompt) == at and whole[at:at + len(res.tokens)] == res.tokens, turn
        assert row.log_probs[at - len(row.prompt):][:len(res.tokens)] == res.log_probs
        assert row.versions[at - len(row.prompt):][:len(res.tokens)] == res.versions
        assert not any(row.observation_mask[at - len(row.prompt):][:len(res.tokens)])
        if turn:  # the history is the session's cached prefix: only the new observation is prefilled
            assert res.reused_tokens >= len(req.prompt) - len(observation_tokens) - 1
        at += len(res.tokens)
        if turn < 2:  # then the observation: mask 1, and exactly what chat.observation appended
            observation_tokens = whole[at:len(driver.seen[turn + 1].request.prompt)]
            assert observation_tokens[-1] == CHAT.ids[chat_module.ASSISTANT]
            assert all(row.observation_mask[at - len(row.prompt):at - len(row.prompt) + len(observation_tokens)])
            at += len(observation_tokens)
    assert at == len(whole)
    assert driver.stats["reused_tokens"] / (driver.stats["reused_tokens"] + driver.stats["prefill_tokens"]) > 0.5
    assert "[exit" in CHAT.decode(whole) or "[no command run" in CHAT.decode(whole)


def test_observation_positions_have_no_policy_gradient(model):
    """Changing the behaviour log-probs and the values at observation positions leaves the
    advantages on actions and the policy's update unchanged."""
    rng = np.random.default_rng(0)
    obs = [0] * 5 + [1] * 6 + [0] * 5 + [1] * 4 + [0] * 3
    comp = [int(t) for t in rng.integers(0, 256, len(obs))]
    lp = [float(-x) if not o else 0.0 for x, o in zip(rng.uniform(0.5, 3.0, len(obs)), obs)]
    rows = [ro.Trajectory([257, 10, 20, 258], comp, lp, [0] * len(obs), r, rollout_id=i, observation_mask=obs)
            for i, r in enumerate((1.0, 0.0))]
    batch = ro.to_batch(rows, length=32)
    mask = np.asarray(batch.action_mask)
    own, _ = token_logprobs(model, batch.tokens)  # ratios near 1 on actions: inside the band, so they train
    batch = batch._replace(logp_rollout=jnp.where(mask > 0, own + 0.05 * rng.normal(size=mask.shape), 0.0))
    noise = np.where(mask == 0, rng.normal(0, 3, mask.shape), 0).astype(np.float32)
    noise[:, :4] = 0  # the prompt stays the prompt
    values = jnp.asarray(rng.normal(0, 1, mask.shape), jnp.float32)
    adv_a, _ = sao.sao_advantages(batch._replace(values=values), alpha=1.5)
    adv_b, _ = sao.sao_advantages(batch._replace(values=values + noise), alpha=1.5)
    np.testing.assert_allclose(np.asarray(adv_a) * mask, np.asarray(adv_b) * mask, atol=1e-6)

    cfg = RLConfig(algorithm="sao", eps_low=0.2, eps_high=4.0, alpha=1.5, actor_lr=1e-3, critic_lr=1e-3, critic_steps=1,
                   critic_warmup=0, grad_clip=1.0, temperature=1.0)
    updated = []
    for b in (batch, batch._replace(logp_rollout=batch.logp_rollout + noise)):
        policy = nnx.clone(model)
        learner = Learner(policy, ValueModel(nnx.clone(model)), cfg)
        learner.step(b)
        updated.append(jax.tree.leaves(nnx.state(policy, nnx.Param)))
    assert any(float(jnp.abs(a - m).max()) > 0 for a, m in zip(updated[0], jax.tree.leaves(nnx.state(model, nnx.Param))))
    for a, b in zip(*updated):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


class ScriptedEnv:
    """An in-process environment: `behaviour` is "ok" (two steps, reward 1), "hang" (its
    first step never returns in time) or "crash" (its verifier raises)."""

    def __init__(self, behaviour: str):
        self.behaviour, self.steps = behaviour, 0

    def reset(self, task):
        return f"task {task.id}"

    def step(self, action):
        self.steps += 1
        if self.behaviour == "hang":
            time.sleep(5)
        if self.steps < 2:
            return Step("out\n", 0.0, False, {})
        if self.behaviour == "crash":
            raise RuntimeError("the verifier crashed")
        return Step("", 1.0, True, {})

    def finish(self):
        return Step("", 0.0, True, {})

    def close(self):
        pass


def test_a_hanging_command_and_a_crashing_verifier_each_drop_one_episode(model):
    tasks = [dataclasses.replace(t, id=f"t{i}") for i, t in enumerate(families.make_tasks("lookup", 6, seed=1))]
    behaviours = {0: "hang", 3: "crash"}
    driver = Driver(GlmEngine(model, max_concurrent_decodes=4, max_len=128))

    def make(task, rid):
        return Episode(task, ScriptedEnv(behaviours.get(rid, "ok")), CHAT, turn_tokens=6, window=120, seed=rid,
                       session_id=f"r{rid}")

    admission = ro.Admission(batch_size=6, eta=0, max_concurrent=6)
    collector = Collector(driver, admission, make, itertools.cycle(tasks), workers=3, env_timeout=1.0)
    driver.start()
    try:
        deadline = time.time() + 60
        while collector.ready_rollouts() < 6 and time.time() < deadline:  # two more replace the dropped
            collector.poll(0)
            time.sleep(0.01)
        batch = collector.take(4)
    finally:
        driver.stop()
        collector.close()
    assert batch is not None and sorted(tr.rollout_id for tr in batch) == [1, 2, 4, 5]
    assert all(tr.reward == 1.0 for tr in batch)
    assert dict(collector.dropped) == {"env_timeout": 1, "env_error": 1}
    assert admission.accepted == 6 and admission.dropped == 2 and admission.running == 0


class _FailingWork:
    """A rollout whose one piece of environment work runs 0.2 s, then raises."""

    def next(self):
        def work():
            time.sleep(0.2)
            raise RuntimeError("the sandbox crashed")
        return work

    def close(self):
        pass


def test_environment_seconds_stop_when_the_work_ends_not_at_the_next_poll():
    admission = ro.Admission(batch_size=1, eta=0, max_concurrent=1)
    collector = Collector(None, admission, lambda task, rid: _FailingWork(), itertools.repeat("task"), workers=1)
    try:
        collector.poll(0)
        time.sleep(1.0)  # the learner's step: the loop does not poll
        collector.poll(0)
    finally:
        collector.close()
    assert dict(collector.dropped) == {"env_error": 1}
    assert 0.2 <= collector.env_seconds < 0.6


class AlternatingEnv(ScriptedEnv):
    """Rewards 1 on even rollout ids, 0 on odd: each GRPO group has a winner and a loser."""

    def __init__(self, rid: int):
        super().__init__("ok")
        self.rid = rid

    def step(self, action):
        step = super().step(action)
        return step._replace(reward=float(self.rid % 2 == 0)) if step.done else step


def test_grpo_groups_episodes_of_one_task_and_trains_on_their_relative_rewards(model):
    """group_size 2 on episodes: a batch holds whole groups, both members the same task, and
    the learner's GRPO step gives the winner a positive advantage and the loser a negative one."""
    tasks = [dataclasses.replace(t, id=f"t{i}") for i, t in enumerate(families.make_tasks("lookup", 4, seed=2))]
    driver = Driver(GlmEngine(model, max_concurrent_decodes=4, max_len=128))

    def make(task, rid):
        return Episode(task, AlternatingEnv(rid), CHAT, turn_tokens=6, window=120, temperature=1.0, seed=rid,
                       session_id=f"g{rid}")

    admission = ro.Admission(batch_size=4, eta=0, max_concurrent=4)
    collector = Collector(driver, admission, make, itertools.cycle(tasks), group_size=2, workers=2)
    driver.start()
    try:
        batch, deadline = None, time.time() + 60
        while batch is None and time.time() < deadline:
            collector.poll(0)
            batch = collector.take(4)
            time.sleep(0.01)
    finally:
        driver.stop()
        collector.close()
    assert batch is not None and sorted(tr.rollout_id for tr in batch) == [0, 1, 2, 3]
    by_group = {}
    for tr in batch:
        by_group.setdefault(tr.rollout_id // 2, []).append(tr)
    assert all(len({tr.task_id for tr in g}) == 1 and len(g) == 2 for g in by_group.values())
    arrays = ro.to_batch(batch, length=128)
    group_ids = np.asarray([tr.rollout_id // 2 for tr in batch])
    cfg = RLConfig(algorithm="grpo", group_size=2, eps_low=0.2, eps_high=0.2, alpha=1.5, actor_lr=1e-3, critic_lr=1e-3,
                   temperature=1.0)
    learner = Learner(nnx.clone(model), None, cfg)
    metrics = learner.step(arrays, group_ids=group_ids)
    assert np.isfinite(metrics["policy_loss"])
    adv, mask = np.asarray(learner.last_advantages), np.asarray(arrays.action_mask) > 0
    for i, tr in enumerate(batch):
        assert np.all(np.sign(adv[i][mask[i]]) == (1 if tr.reward == 1.0 else -1)), (tr.rollout_id, tr.reward)
        assert np.all(adv[i][~mask[i]] == 0)  # observation and prompt tokens get none


def test_glm_tool_calls_run_in_the_shell_env():
    task = families.make_tasks("lookup", 1, seed=2, difficulty=1)[0]
    key, answer = task.metadata["demonstration"][0].split()[1][:-1], None
    env = ShellEnv(show_help=False, action_format="glm")
    env.reset(task)
    out = env.step(f"I look first.<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>grep {key}= kv"
                   "</arg_value>\n</tool_call>")
    answer = out.observation.split("=")[1].split()[0]
    assert not out.done and out.observation.startswith(f"{key}=")
    bad = env.step("<tool_call>python\n<arg_key>code</arg_key>\n<arg_value>1</arg_value>\n</tool_call>")
    assert "unknown tool 'python'" in bad.observation and not bad.done
    done = env.step(f"<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>echo {answer} >ans</arg_value>\n"
                    "</tool_call>\n<tool_call>submit\n</tool_call>")
    env.close()
    assert done.done and done.reward == 1.0
    assert parse_tool_call("<tool_call>bash\n<arg_key>cmd</arg_key><arg_value>ls</arg_value></tool_call>").error == (
        "tool 'bash' needs <arg_key>command</arg_key>")


def test_byte_chat_increments_equal_the_whole_conversation():
    tokens = CHAT.start("list /app", system="be brief")  # [system] be brief [user] list /app [assistant]
    action = CHAT.encode_text("<bash>ls</bash>") + [CHAT.tool_call_id]  # as sampled: the stop token ends it
    tokens += action + CHAT.observation("a b\n", after=action)
    assert tokens[-1] == CHAT.ids[chat_module.ASSISTANT] and tokens.count(CHAT.tool_call_id) == 1
    turns = [Turn("system", "be brief"), Turn("user", "list /app"), Turn("assistant", "<bash>ls</bash>"),
             Turn("observation", "a b\n")]
    bounds = [9, 19, 35, 40]  # where each turn's tokens end (a role token opens its turn)
    chat_module.check(CHAT, turns, tokens, bounds)
    with pytest.raises(ValueError, match=r"at token 38, in turn 3 \(observation"):
        chat_module.check(CHAT, turns[:3] + [Turn("observation", "a c\n")], tokens, bounds)


GLM_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content }}"
    "{% elif m.role == 'tool' %}<|observation|>{{ m.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _tokenizer(template):
    """A word-level tokenizer built here (no downloads), GLM's role tokens special."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "list the files ls a b c d echo done ok run cat kv ans = 1 2 3 4 < > / bash".split()
    vocab = {w: i for i, w in enumerate(["[UNK]", *chat_module.ROLES, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=chat_module.EOS,
                                   additional_special_tokens=list(chat_module.ROLES[:4]))
    fast.chat_template = template
    return fast


def test_hf_chat_template_checked_turn_by_turn():
    chat = HFChat(_tokenizer(GLM_TEMPLATE))
    turns = [Turn("user", "list the files")]
    tokens = chat.start("list the files")
    bounds = [len(tokens)]
    for action, output in (("ls", "a b c"), ("cat kv", "1 2")):
        sampled = chat.encode_text(action) + [chat.tool_call_id]  # as a model would end its tool call
        tokens += sampled + chat.observation(output, after=sampled)
        turns += [Turn("assistant", action), Turn("observation", output)]
        bounds += [bounds[-1] + len(sampled) - 1, len(tokens)]
        chat_module.check(chat, turns, tokens, bounds)
    assert chat.tool_call_id == chat.ids[chat_module.OBSERVATION] in chat.stop_ids and chat.decode(tokens).split() == "list the files ls a b c " \
        "cat kv 1 2".split()

    # A template that drops past tool output on re-render is not append-only: the check names the turn.
    forgetful = GLM_TEMPLATE.replace("{% elif m.role == 'tool' %}<|observation|>{{ m.content }}",
                                     "{% elif m.role == 'tool' %}<|observation|>{% if loop.last %}{{ m.content }}"
                                     "{% endif %}")
    with pytest.raises(ValueError, match=r"turn 2 \(observation: 'a b c'\)"):
        chat_module.check(HFChat(_tokenizer(forgetful)), turns, tokens, bounds)


def test_collector_runs_one_turn_tasks_through_the_same_protocol(model):
    """A text task is a rollout like an episode: engine turn, then its verifier in the pool."""
    from rl.compaction import Answer

    tasks = families.make_tasks("sorting", 3, seed=0, difficulty=1)
    driver = Driver(GlmEngine(model, max_concurrent_decodes=4, max_len=64))
    rollouts = [ro.TextRollout(t, Answer(ro.encode(t.prompt), 6, stop_ids=ro.encode("\n"))) for t in tasks]
    drive(driver, rollouts)
    for t, r in zip(tasks, rollouts):
        assert r.reward == t.verify(r.text) and len(r.trajectories(0)) == 1
    assert list(itertools.chain(*(r.trajectories(0)[0].completion for r in rollouts)))


class EndlessEnv(ScriptedEnv):
    """Answers every action with the same output until the episode is finished."""

    def step(self, action):
        self.steps += 1
        return Step("output\n", 0.0, False, {})

    def finish(self):
        return Step("", 1.0, True, {"finished": True})


def test_an_episode_outgrowing_the_window_compacts_and_every_segment_trains_with_its_reward():
    from rl.compaction import Compaction
    from rl.engine.driver import Request, Result

    task = families.make_tasks("lookup", 1, seed=0)[0]
    compaction = Compaction(window=90, summary_tokens=5, max_segments=3)
    episode = Episode(task, EndlessEnv("ok"), CHAT, turn_tokens=12, window=90, compaction=compaction,
                      min_turn_tokens=4)
    close = CHAT.encode_text(compaction.close)
    summaries = 0
    while (work := episode.next()) is not None:
        if not isinstance(work, Request):
            work()
            continue
        assert len(work.prompt) + work.max_new_tokens <= 90
        if work.prompt[-1] == CHAT.encode_text(compaction.open)[0]:  # the summary request
            summaries += 1
            tokens = CHAT.encode_text(f"s{summaries}") + close
        else:
            tokens = CHAT.encode_text("<bash>ls</bash>")[:work.max_new_tokens - 1] + [CHAT.tool_call_id]
        episode.receive(Result(tokens, [-0.5] * len(tokens), [summaries] * len(tokens), "stop"))
    rows = episode.trajectories(rollout_id=3)
    assert summaries == 2 and len(rows) == 3 and episode.finish_reason == "length" and episode.reward == 1.0
    assert [r.segment_index for r in rows] == [0, 1, 2] and [r.reward for r in rows] == [1.0] * 3
    assert [r.finish_reason for r in rows] == ["compacted", "compacted", "length"]
    for i, row in enumerate(rows[1:], 1):  # a new segment starts from the task and the summary
        summary = CHAT.encode_text(compaction.open) + CHAT.encode_text(f"s{i}") + close
        head = rows[0].prompt[:-1] + summary
        assert row.prompt in (head, head + rows[0].prompt[-1:])
        if row.prompt == head:  # the output that set compaction off opens the segment, as an observation
            opening = CHAT.observation("output\n", after=())
            assert row.completion[:len(opening)] == opening and all(row.observation_mask[:len(opening)])
    for row in rows[:2]:  # the summary is the segment's last action; the OPEN before it is not one
        assert row.completion[-len(close) - 2:] == CHAT.encode_text(f"s{rows.index(row) + 1}") + close
        assert row.observation_mask[-len(close) - 3] == 1
    assert all(len(r.prompt) + len(r.completion) <= 90 for r in rows)
