"""Staleness admission, learner batches from trajectories, and the byte tokenizer."""

import numpy as np
import pytest

from rl import rollout as ro


def test_synchronous_admission_is_one_batch_per_version():
    a = ro.Admission(batch_size=4, eta=0, max_concurrent=16)
    assert a.capacity(version=0) == 4
    a.started(4)
    assert a.capacity(0) == 0
    for _ in range(4):
        a.finished(accepted=True)
    assert a.capacity(0) == 0  # the batch of version 0 is full
    assert a.capacity(1) == 4  # one update later, the next batch


def test_async_admission_allows_eta_versions_ahead_and_respects_slots():
    a = ro.Admission(batch_size=4, eta=2, max_concurrent=6)
    assert a.capacity(0) == 6  # (2 + 0 + 1) * 4 = 12 allowed, 6 slots
    a.started(6)
    assert a.capacity(0) == 0
    for _ in range(6):
        a.finished(accepted=True)
    assert a.capacity(0) == 6  # 12 - 6 accepted
    a.started(6)
    assert a.capacity(0) == 0 and a.capacity(1) == 0  # 12 in flight or accepted; and no free slot
    a.finished(accepted=False)  # a dropped sample frees budget without counting
    assert a.capacity(0) == 1


def test_admission_state_round_trip_and_bad_eta():
    a = ro.Admission(4, 1, 8)
    a.started(3)
    a.finished(True)
    b = ro.Admission(4, 1, 8)
    b.load_state_dict(a.state_dict())
    assert b.accepted == 1 and b.running == 0
    with pytest.raises(ValueError, match="eta"):
        ro.Admission(4, -1, 8)


def test_rollout_ids_stay_unique_when_samples_are_dropped():
    a, ids = ro.Admission(4, 2, 8), []
    for finished in (None, False, True, False, None, True):  # start one; drop or keep the oldest running
        ids.append(a.issued)
        a.started()
        if finished is not None:
            a.finished(finished)
    assert ids == list(range(6))
    b = ro.Admission(4, 2, 8)
    b.load_state_dict(a.state_dict())  # in-flight rollouts are reissued with their ids after a resume
    assert (b.accepted, b.dropped, b.issued) == (2, 2, 4)


def test_rejected_rollouts_free_their_budget_and_keep_their_ids():
    a = ro.Admission(batch_size=8, eta=0, max_concurrent=8)
    a.started(8)
    for _ in range(8):
        a.finished(True)
    assert a.capacity(0) == 0 and a.issued == 8
    a.rejected(4)  # a group of four that dynamic sampling drops once complete
    assert (a.accepted, a.dropped, a.issued, a.capacity(0)) == (4, 4, 8, 4)
    with pytest.raises(ValueError, match="cannot reject 5 rollouts"):
        a.rejected(5)


def test_trajectory_staleness_is_from_its_oldest_token():
    tr = ro.Trajectory([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [3, 4, 4], 1.0, rollout_id=0)
    assert tr.staleness(6) == 3 and tr.length == 5


def test_to_batch_masks_prompt_padding_and_observations():
    a = ro.Trajectory([7, 8], [9, 10, 11], [-1.0, -2.0, -3.0], [0, 0, 1], 1.0, rollout_id=5)
    b = ro.Trajectory([7], [12, 13, 14, 15], [-0.5] * 4, [1] * 4, 0.0, rollout_id=6, segment_index=1,
                      observation_mask=[0, 1, 1, 0])
    batch = ro.to_batch([a, b], length=6)
    np.testing.assert_array_equal(np.asarray(batch.tokens), [[7, 8, 9, 10, 11, 0], [7, 12, 13, 14, 15, 0]])
    np.testing.assert_array_equal(np.asarray(batch.action_mask), [[0, 0, 1, 1, 1, 0], [0, 1, 0, 0, 1, 0]])
    np.testing.assert_array_equal(np.asarray(batch.logp_rollout)[0], [0, 0, -1, -2, -3, 0])
    np.testing.assert_array_equal(np.asarray(batch.versions)[0], [0, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(batch.rewards), [1.0, 0.0])
    np.testing.assert_array_equal(np.asarray(batch.rollout_id), [5, 6])
    np.testing.assert_array_equal(np.asarray(batch.segment_index), [0, 1])
    with pytest.raises(ValueError, match="more than the batch length"):
        ro.to_batch([a], length=4)


def test_byte_tokenizer_round_trip():
    text = "sort 4 2 9 1=1 2 4 9\n"
    assert ro.decode(ro.encode(text)) == text
    assert max(ro.encode(text)) < 256


def test_engine_client_completes_through_the_driver():
    import glmjax
    from rl.engine.driver import Driver
    from rl.engine.engine import GlmEngine
    from rl.env_client import EngineClient
    from tests.glmjax.test_sharding import CONFIG

    model = glmjax.init_model(CONFIG.replace(vocab_size=256), seed=0)
    client = EngineClient(Driver(GlmEngine(model, max_concurrent_decodes=2, max_len=64)))
    text = client.complete("sort 3 1 2=", max_tokens=5)
    expected = glmjax.generate(model, [ro.encode("sort 3 1 2=")], 5)[0, 11:]
    assert text == ro.decode(list(map(int, expected)))
    # sampled requests draw with their own seeds: the samples of pass@k are not one sample repeated
    samples = {client.complete("sort 3 1 2=", max_tokens=8, temperature=1.0) for _ in range(4)}
    assert len(samples) > 1, samples
