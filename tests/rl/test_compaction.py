"""Compaction: segment layout, the rollout state machine, per-rollout normalisation, and
the engine's log-probs matching the learner's on compacted segments."""

import numpy as np
import pytest

from envs import families
from rl import rollout as ro
from rl import sao
from rl.compaction import Answer, Compaction, oracle_segments
from rl.engine.driver import Result

COMPACT = Compaction(window=40, summary_tokens=4)


def _result(text, reason, logp=-0.5, version=3):
    tokens = ro.encode(text)
    return Result(tokens, [logp] * len(tokens), [version] * len(tokens), reason)


def test_oracle_segments_fit_the_window_and_join_to_the_answer():
    for task in families.make_tasks("counting", 20, seed=3, difficulty=5):
        prompt, answer = ro.encode(task.prompt), ro.encode(task.oracle())
        assert len(prompt) + len(answer) > COMPACT.window
        segments = oracle_segments(prompt, answer, COMPACT)
        assert 2 <= len(segments) <= COMPACT.max_segments
        joined = ""
        for i, s in enumerate(segments):
            assert len(s.prompt) + len(s.completion) <= COMPACT.window
            text = ro.decode(s.completion)
            if i < len(segments) - 1:
                body, summary = text.split("|")
                assert s.observation_mask == [0] * len(body) + [1] + [0] * len(summary)
                # the summary is the last whole term, and the next context is prompt + it
                assert summary == body.split()[-1] + ";"
                assert ro.decode(segments[i + 1].prompt) == task.prompt + "|" + summary
                joined += body
            else:
                assert not any(s.observation_mask)
                joined += text
        assert joined == task.oracle() and task.verify(joined) == 1.0


def test_short_answers_are_one_segment_without_compaction():
    task = families.make_tasks("counting", 1, seed=0, difficulty=1)[0]
    (s,) = oracle_segments(ro.encode(task.prompt), ro.encode(task.oracle()), None)
    assert ro.decode(s.prompt + s.completion) == task.prompt + task.oracle()
    with pytest.raises(ValueError, match="does not fit"):
        long = families.make_tasks("counting", 1, seed=0, difficulty=5)[0]
        oracle_segments(ro.encode(long.prompt), ro.encode("1234567890" * 5 + "\n"), COMPACT)


def test_rollout_requests_cut_at_a_word_then_summarise_then_continue():
    prompt = ro.encode("count 10 to 40 by 3=")  # 20 tokens
    r = Answer(prompt, 48, compaction=COMPACT, stop_ids=[10], temperature=0.7, seed=5)
    req = r.request()
    assert req.prompt == prompt and req.max_new_tokens == 40 - 20 - 5 and req.stop_ids == (10,)
    r.receive(_result("10 13 16 19 2", "length", logp=-0.1, version=1))  # cut mid-number
    req = r.request()
    assert ro.decode(req.prompt) == "count 10 to 40 by 3=10 13 16 19 |" and req.stop_ids == tuple(ro.encode(";"))
    assert req.max_new_tokens == 4 and req.seed != 5
    r.receive(_result("19;", "stop", logp=-0.2, version=2))
    assert ro.decode(r.request().prompt) == "count 10 to 40 by 3=|19;"
    r.receive(_result("22 25 28 31 34 37 40\n", "stop", version=3))
    assert r.done and r.finish_reason == "stop" and r.request() is None
    assert r.text == "10 13 16 19 22 25 28 31 34 37 40\n"
    first, last = r.trajectories(1.0, rollout_id=7, task_id="t")
    assert ro.decode(first.completion) == "10 13 16 19 |19;" and first.segment_index == 0
    assert first.log_probs == [-0.1] * 12 + [0.0] + [-0.2] * 3
    assert first.versions == [1] * 12 + [2] + [2] * 3 and first.observation_mask[12] == 1
    assert last.segment_index == 1 and last.rollout_id == first.rollout_id == 7 and last.observation_mask is None
    assert first.finish_reason == "compacted" and last.finish_reason == "stop"


def test_rollout_ends_unfinished_when_it_cannot_compact():
    prompt = ro.encode("count 10 to 40 by 3=")
    r = Answer(prompt, 48, compaction=COMPACT)
    r.receive(_result("1013161922252", "length"))  # no whole word to keep
    assert r.done and r.finish_reason == "length" and len(r.segments) == 1
    r = Answer(prompt, 48, compaction=COMPACT)
    r.receive(_result("10 13 16 ", "length"))
    r.receive(_result("999", "length"))  # the summary overran its budget
    assert r.done and r.finish_reason == "length" and r.text == "10 13 16 "
    capped = Answer(prompt, 200, compaction=Compaction(window=40, summary_tokens=4, max_segments=2))
    capped.receive(_result("10 13 16 ", "length"))
    capped.receive(_result("16;", "stop"))
    assert capped.request().max_new_tokens == 40 - 20 - 4  # the last segment may fill the window
    with pytest.raises(ValueError, match="window"):
        Answer(ro.encode("x" * 30), 10, compaction=COMPACT)


def test_a_compacted_rollout_counts_once_in_the_loss():
    prompt = ro.encode("count 10 to 40 by 3=")
    r = Answer(prompt, 48, compaction=COMPACT)
    for text, reason in [("10 13 16 ", "length"), ("16;", "stop"), ("19 22 25 ", "length"), ("25;", "stop"),
                         ("28 31 34 37 40\n", "stop")]:
        r.receive(_result(text, reason))
    compacted = r.trajectories(1.0, rollout_id=0)
    plain = Answer(prompt, 48)
    plain.receive(_result("10 13 16 19 22 25 28 31 34 37 40\n", "stop"))
    rows = compacted + plain.trajectories(0.0, rollout_id=1)
    batch = ro.to_batch(rows, length=64, rows=8)
    assert batch.tokens.shape == (8, 64) and len(set(np.asarray(batch.rollout_id).tolist())) == 6
    w = np.asarray(sao.rollout_token_weights(batch.action_mask, batch.rollout_id))
    np.testing.assert_allclose(w[:3].sum(), 1.0, rtol=1e-6)  # three segments, one rollout
    np.testing.assert_allclose(w[3].sum(), 1.0, rtol=1e-6)
    assert w[4:].sum() == 0 and np.asarray(batch.action_mask)[4:].sum() == 0
    # the reward is read on the last segment only, and GAE chains the segments
    returns = np.asarray(sao.place_rewards(batch.rewards, batch.action_mask, batch.rollout_id, batch.segment_index))
    assert returns[:2].sum() == 0 and returns[2].sum() == 1.0 and returns[3].sum() == 0


def test_engine_log_probs_match_the_learner_on_compacted_segments():
    """A greedy rollout through the real engine compacts once (the separator and CLOSE are
    chosen from the model's own greedy continuation, so the cut and the summary happen);
    its segments' recorded log-probs equal the learner's recomputation on the rows."""
    import glmjax
    from rl.engine.driver import Driver
    from rl.engine.engine import GlmEngine
    from rl.learner import token_logprobs
    from tests.engine_util import TINY, greedy_reference

    model = glmjax.init_model(TINY, seed=0)
    window, summary = 32, 4
    prompt = ro.encode("count 1 to 9=")
    budget = window - len(prompt) - (1 + summary)
    answer = greedy_reference(model, prompt, budget)
    separator = answer[budget // 2]
    kept = answer[:max(i for i, t in enumerate(answer) if t == separator) + 1]
    close = greedy_reference(model, prompt + kept + ro.encode("|"), 2)[1]
    compaction = Compaction(window=window, summary_tokens=summary, max_segments=2, separator=chr(separator),
                            close=chr(close))
    driver = Driver(GlmEngine(model, max_concurrent_decodes=2, max_len=window + 1))  # + the engine's spare entry
    r = Answer(prompt, 40, compaction=compaction, session_id="r")
    while not r.done:
        h = driver.submit(r.request())
        driver.run_until_idle()
        r.receive(h.result())
    rows = r.trajectories(0.0, rollout_id=0)
    assert [tr.segment_index for tr in rows] == [0, 1] and rows[0].completion[:len(kept)] == kept
    batch = ro.to_batch(rows, length=window)
    logp, _ = token_logprobs(model, batch.tokens)
    mask = np.asarray(batch.action_mask) > 0
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(batch.logp_rollout)[mask], atol=2e-4)
