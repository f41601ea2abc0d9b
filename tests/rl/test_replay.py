"""rl/replay.py: mixed-precision storage, proportional sampling, importance weights, eviction, state."""

import io
import json

import ml_dtypes
import numpy as np
import pytest

from rl.replay import ReplayBuffer, mean_abs_priority


def _rows(n, t=4, start=0, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.integers(0, 50_000, (n, t)).astype(np.int64),
        "action_mask": rng.random((n, t)) < 0.5,
        "logp_rollout": -rng.random((n, t)).astype(np.float32) * 10,
        "advantages": rng.normal(size=(n, t)).astype(np.float32),
        "rewards": rng.normal(size=n).astype(np.float32),
        "row": np.arange(start, start + n),
    }


def test_mixed_precision_round_trip():
    buf = ReplayBuffer(8)
    rows = _rows(8)
    buf.add(rows)
    stored = buf._data
    assert stored["logp_rollout"].dtype == ml_dtypes.bfloat16 and stored["advantages"].dtype == ml_dtypes.bfloat16
    assert stored["tokens"].dtype == np.int32 and stored["rewards"].dtype == np.float32
    assert stored["action_mask"].dtype == np.bool_
    out = buf.sample(64)
    i = out.data["row"]
    assert out.data["logp_rollout"].dtype == np.float32
    for name in ("logp_rollout", "advantages"):  # bfloat16: 8 significant bits, error <= 2^-9 relative
        np.testing.assert_allclose(out.data[name], rows[name][i], rtol=2.0 ** -8, atol=0)
    for name in ("tokens", "action_mask", "rewards"):
        np.testing.assert_array_equal(out.data[name], rows[name][i])
    assert buf.nbytes < sum(v.nbytes for v in rows.values())


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_sampling_frequencies_follow_priorities(alpha):
    prio = np.array([1.0, 2.0, 3.0, 4.0])
    buf = ReplayBuffer(4, alpha=alpha, eps=0.0, seed=1)
    buf.add(_rows(4), priorities=prio)
    n = 40_000
    counts = np.bincount(buf.sample(n).data["row"], minlength=4)
    p = prio ** alpha / np.sum(prio ** alpha)
    chi2 = np.sum((counts - n * p) ** 2 / (n * p))
    assert chi2 < 16.27, (chi2, counts, n * p)  # 99.9% quantile of chi-square, 3 degrees of freedom


def test_importance_weights_formula():
    prio = np.array([1.0, 2.0, 5.0])
    buf = ReplayBuffer(5, alpha=0.7, beta=0.4, eps=0.0)
    buf.add(_rows(3), priorities=prio)
    out = buf.sample(200, beta=0.6)
    p = prio ** 0.7 / np.sum(prio ** 0.7)
    w = (3 * p) ** -0.6 / np.max((3 * p) ** -0.6)
    np.testing.assert_allclose(out.weights, w[out.data["row"]], rtol=1e-6)
    assert out.weights.max() <= 1.0


def test_new_rows_enter_at_max_priority_and_updates_apply():
    buf = ReplayBuffer(4, alpha=1.0, eps=0.0)
    idx = buf.add(_rows(2), priorities=[3.0, 1.0])
    assert list(idx) == [0, 1]
    buf.add(_rows(1, start=2))  # priority 3 (the max)
    np.testing.assert_allclose(buf._priority[:3], [3.0, 1.0, 3.0])
    buf.update_priorities(np.array([1, 2]), np.array([-8.0, 0.5]))  # stored as |p|
    np.testing.assert_allclose(buf._priority[:3], [3.0, 8.0, 0.5])
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 3\)"):
        buf.update_priorities([3], [1.0])


def test_eviction_of_the_oldest_and_stale_updates():
    buf = ReplayBuffer(3, alpha=1.0, eps=0.0, seed=2)
    buf.add(_rows(2, start=0))
    buf.add(_rows(3, start=2))  # rows 0, 1 evicted
    assert len(buf) == 3
    out = buf.sample(100)
    assert set(out.data["row"]) == {2, 3, 4}
    np.testing.assert_array_equal(out.indices, out.data["row"])  # insertion index of the sampled row
    buf.update_priorities([0, 3], [100.0, 7.0])  # 0 was evicted: its slot now holds row 3, untouched by 0
    live = {int(r): p for r, p in zip(buf._data["row"], buf._priority)}
    assert live[3] == 7.0 and max(live.values()) == 7.0
    buf.add(_rows(7, start=5))  # more than capacity at once: only the last 3 are kept
    assert sorted(buf._data["row"]) == [9, 10, 11]
    out = buf.sample(50)
    np.testing.assert_array_equal(out.indices, out.data["row"])


def test_state_round_trip_through_npz_and_json():
    buf = ReplayBuffer(6, alpha=0.8, beta=0.5, seed=3)
    buf.add(_rows(4), priorities=[1.0, 2.0, 3.0, 4.0])
    buf.sample(5)
    state = buf.state_dict()
    f = io.BytesIO()
    np.savez(f, **state["arrays"])
    f.seek(0)
    loaded = {"arrays": dict(np.load(f)), "meta": json.loads(json.dumps(state["meta"]))}
    other = ReplayBuffer(6, seed=99)
    other.load_state_dict(loaded)
    a, b = buf.sample(20), other.sample(20)
    for name in a.data:
        np.testing.assert_array_equal(a.data[name], b.data[name])
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.weights, b.weights)
    assert other._data["logp_rollout"].dtype == ml_dtypes.bfloat16 and len(other) == 4
    with pytest.raises(ValueError, match="capacity 6, this buffer 5"):
        ReplayBuffer(5).load_state_dict(state)


def test_errors_name_the_field():
    buf = ReplayBuffer(4)
    buf.add(_rows(2))
    bad = _rows(2, t=5)
    with pytest.raises(ValueError, match=r"'tokens' has shape \(2, 5\), expected \(n,\) \+ \(4,\)"):
        buf.add(bad)
    with pytest.raises(ValueError, match="differ from the stored"):
        buf.add({"tokens": np.zeros((1, 4), np.int32)})
    with pytest.raises(ValueError, match="outside int32"):
        buf.add({**_rows(1), "row": np.array([2**40])})
    with pytest.raises(ValueError, match="empty buffer"):
        ReplayBuffer(2).sample(1)


def test_mean_abs_priority():
    adv = np.array([[1.0, -3.0, 9.0], [0.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 0], [0, 0, 0]])
    np.testing.assert_allclose(mean_abs_priority(adv, mask), [2.0, 0.0])
