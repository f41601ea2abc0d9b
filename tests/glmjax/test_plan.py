"""The memory planner against eval_shape and against real sharded parameters."""

import jax
import pytest
from flax import nnx

import glmjax
from glmjax import plan, sharding
from tests.glmjax.test_sharding import CONFIG
from tests.presets_util import REPO


def test_parameter_bytes_equal_eval_shape_total():
    state = plan.abstract_state(CONFIG)
    expected = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    p = plan.plan(CONFIG, {"fsdp": 4, "expert": 2}, device_memory=16e9, batch=8, seq=64, serve_batch=8,
                  serve_len=128, state=state)
    assert p.param_bytes_total == expected


def test_per_device_parameter_bytes_match_a_sharded_model():
    mesh_sizes = {"data": 2, "expert": 2, "tensor": 2}
    mesh = sharding.make_mesh(**mesh_sizes)
    with sharding.use_mesh(mesh):
        model = glmjax.init_model(CONFIG, mesh=mesh)
    actual = sharding.per_device_bytes(nnx.state(model))
    p = plan.plan(CONFIG, mesh_sizes, device_memory=16e9, batch=8, seq=64, serve_batch=8, serve_len=128)
    assert abs(p.params - max(actual.values())) <= 1e-6 * p.params


def test_cli_reports_fit_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = plan.main(["--config", str(REPO / "configs/tiny.py"), "--mesh", "fsdp=2,expert=2", "--device-memory-gb", "1",
                      "--batch", "4", "--seq", "64", "--serve-batch", "16",
                      "--json", str(out)])
    assert code == 0
    assert "training fits, serving fits, RL fits" in capsys.readouterr().out
    assert out.exists()
    assert plan.main(["--config", str(REPO / "configs/tiny.py"), "--mesh", "fsdp=2", "--device-memory-gb", "0.000001"]) == 1


COMMON = dict(device_memory=16e9, batch=8, seq=64, serve_batch=8, serve_len=128, slots=4, rollout_len=128)
HEAD = 64 + 1  # the value head [D] and its bias, fp32


def test_rl_roles_counted_by_hand():
    """CONFIG on one device: fp32, D=64, 4 layers FSFS (indexers on layers 0 and 2), layers
    1-3 MoE with 8 experts, no MTP."""
    n = glmjax.count_params(CONFIG)
    p = plan.plan(CONFIG, {}, critic="separate", teachers=2, **COMMON)
    assert p.params == 4 * n and p.optimizer == 8 * n  # fp32: two moments, no master copy
    assert p.critic_params == 4 * (n + HEAD) and p.critic_optimizer == 8 * (n + HEAD)  # the trunk's copy + head
    # Per token: c_kv (32) + k_rope (8) on 4 layers, indexer keys (16) on the 2 full-indexer layers; 4 x 128 tokens.
    assert p.rollout_kv_cache == 4 * (4 * (32 + 8) + 2 * 16) * 4 * 128
    # bf16, but for the routers' weight [64, 8] and bias [8] (3 layers) and the indexers' weights_proj [64, 4].
    fp32_values = 3 * (64 * 8 + 8) + 2 * 64 * 4
    assert p.teacher == 2 * (2 * (n - fp32_values) + 4 * fp32_values)
    # The critic's step and the actor's share one gradient buffer, the critic's (larger by the head).
    assert p.rl_total == (p.params + p.optimizer + p.critic_params + p.activations + p.critic_params
                          + p.critic_optimizer + p.rollout_kv_cache + p.teacher)

    shared = plan.plan(CONFIG, {}, critic="shared", **COMMON)
    assert shared.critic_params == 4 * HEAD and shared.critic_optimizer == 8 * HEAD and shared.teacher == 0
    assert shared.rl_total == shared.train_total + 12 * HEAD + shared.rollout_kv_cache
    none = plan.plan(CONFIG, {}, critic="none", **COMMON)
    assert none.rl_total == none.train_total + none.rollout_kv_cache


def test_rl_roles_split_over_the_mesh():
    """fsdp=4 x expert=2: rollout slots split over the 8 batch shards, the head [D] over fsdp x expert."""
    config = CONFIG.replace(num_nextn_predict_layers=1)  # the MTP layer caches c_kv, k_rope and indexer keys
    p = plan.plan(config, {"fsdp": 4, "expert": 2}, critic="shared", **COMMON)
    assert p.rollout_kv_cache == 4 * (4 * (32 + 8) + 2 * 16 + (32 + 8 + 16)) * 4 * 128 / 8
    assert p.critic_params == 4 * (64 / 8 + 1)
    with pytest.raises(ValueError, match="critic='tied'.*separate"):
        plan.plan(config, {}, critic="tied", **COMMON)
