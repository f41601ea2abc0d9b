"""The memory planner against eval_shape and against real sharded parameters."""

import jax
from flax import nnx

import glmjax
from glmjax import plan, sharding
from tests.presets_util import REPO
from tests.test_sharding import CONFIG


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
                      "--batch", "4", "--seq", "64", "--json", str(out)])
    assert code == 0
    assert "training fits" in capsys.readouterr().out
    assert out.exists()
    assert plan.main(["--config", str(REPO / "configs/tiny.py"), "--mesh", "fsdp=2", "--device-memory-gb", "0.000001"]) == 1
