"""rl/learner.py: routing_mismatch and rollout_correction against numpy, and the learner
step with routing replay: the loss runs the engine's experts at every position that scores
an action token."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from rl.config import RLConfig
from rl.engine.driver import Result
from rl.learner import rollout_correction, routing_mismatch
from rl.rollout import RouteLog


def _routes(rng, b, t, layers=3, x=2, e=8):
    return np.stack([rng.permutation(e)[:x] for _ in range(b * t * layers)]).reshape(b, t, layers, x)


def test_routing_mismatch_counts_positions_and_layers_that_differ():
    rng = np.random.default_rng(0)
    b, t = 3, 7
    own = _routes(rng, b, t)
    engine = own[..., ::-1].copy()  # the same sets in another order: no difference
    changed = rng.random((b, t, 3)) < 0.3
    engine[changed] = _routes(rng, 1, int(changed.sum()), layers=1)[0, :, 0]  # fresh draws, some sets equal
    engine[0, 5:] = -1  # unknown positions
    mask = (rng.random((b, t)) < 0.6).astype(np.float32)
    out = routing_mismatch(jnp.asarray(own), jnp.asarray(engine), jnp.asarray(mask), replayed=True)
    known = engine[..., 0, 0] >= 0
    differs = np.array([[[set(own[i, j, k]) != set(engine[i, j, k]) for k in range(3)] for j in range(t)]
                        for i in range(b)])
    np.testing.assert_allclose(out["routing_mismatch_tokens"], differs.any(-1)[known].mean(), rtol=1e-6)
    np.testing.assert_allclose(out["routing_mismatch_layers"], differs.mean(-1)[known].mean(), rtol=1e-6)
    scoring = np.zeros((b, t), bool)
    scoring[:, :-1] = mask[:, 1:] > 0
    np.testing.assert_allclose(out["routing_replayed"], (known & scoring).sum() / scoring.sum(), rtol=1e-6)
    assert float(routing_mismatch(jnp.asarray(own), jnp.asarray(engine), jnp.asarray(mask), False)
                 ["routing_replayed"]) == 0.0


@pytest.mark.parametrize("mode", ["none", "tis", "sequence_mask"])
def test_rollout_correction_against_numpy(mode):
    rng = np.random.default_rng(1)
    b, t, cap = 4, 9, 1.5
    learner = rng.normal(-2, 1, (b, t)).astype(np.float32)
    engine = (learner + rng.normal(0, 0.4, (b, t))).astype(np.float32)
    engine[0] = learner[0] - 1.0  # a row the engine found far less likely
    engine[3] = learner[3]  # a row without mismatch
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    weights = rng.random((b, t)).astype(np.float32)
    rl = RLConfig(rollout_correction=mode, correction_cap=cap)
    old, w, metrics = rollout_correction(jnp.asarray(learner), jnp.asarray(engine), jnp.asarray(mask),
                                         jnp.asarray(weights), rl)
    gap = np.where(mask > 0, learner - engine, 0.0)
    np.testing.assert_allclose(metrics["logp_gap_mean"], np.abs(gap).sum() / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(metrics["logp_gap_max"], np.abs(gap).max(), rtol=1e-6)
    if mode == "none":
        np.testing.assert_array_equal(old, engine)
        np.testing.assert_array_equal(w, weights)
        return
    np.testing.assert_array_equal(old, learner)
    if mode == "tis":
        expected = weights * np.minimum(np.exp(gap), cap)
    else:
        mean = gap.sum(1) / mask.sum(1)
        keep = np.abs(mean) <= np.log(cap)
        assert keep[3] and not keep.all(), mean  # the inputs exercise both branches
        expected = weights * keep[:, None]
    np.testing.assert_allclose(w, expected, rtol=1e-5)


def test_a_route_log_merges_the_turns_of_a_segment():
    """Turn 1 ran positions 0-5; turn 2 reused 0-3 (-1) and ran 4-9: the log holds both."""
    first = np.arange(6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2)
    second = np.full((10, 2, 2), -1, np.int16)
    second[4:] = 100 + np.arange(6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2)
    log = RouteLog()
    assert log.take(3) is None
    for routes in (first, second):
        log.add(types.SimpleNamespace(routes=routes))
    log.add(Result([], [], [], "stop"))  # a result without routes changes nothing
    got = log.take(12)
    np.testing.assert_array_equal(got[:4], first[:4])
    np.testing.assert_array_equal(got[4:10], second[4:])
    assert (got[10:] == -1).all()


def test_with_replay_on_the_job_runs_the_engines_experts_at_every_scoring_position(tmp_path):
    """The main job in bf16 with rl.routing_replay=on and TIS: at every actor step, every
    position that scores an action token ran the experts the engine recorded there, and the
    job logs the routing mismatch and the log-prob gap."""
    import json
    import subprocess

    from tests.rl.test_trainer import REPO, _cmd, _env

    subprocess.run(_cmd(tmp_path, "--config.rl.steps=3", "--config.model.dtype=bfloat16",
                        "--config.rl.routing_replay=on", "--config.rl.rollout_correction=tis"),
                   check=True, env=_env(), cwd=REPO, capture_output=True, timeout=900)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    actor = [r for r in rows if "logp_gap_mean" in r]
    assert len(actor) >= 2, rows
    for r in actor:
        assert r["routing_replayed"] == 1.0, r
        assert 0.0 <= r["routing_mismatch_layers"] <= r["routing_mismatch_tokens"] <= 1.0
        assert np.isfinite(r["logp_gap_mean"]) and r["logp_gap_max"] >= r["logp_gap_mean"]
        assert 0 < r["tis_weight_mean"] <= 2.0
