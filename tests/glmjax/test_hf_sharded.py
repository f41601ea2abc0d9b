"""HF checkpoints load straight into the rules' shardings and save one tensor at a time,
on 8 fake CPU devices (mesh expert=4 x tensor=2)."""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import glmjax
from glmjax import safetensors_io, sharding
from tests.glmjax.test_sharding import CONFIG

CONFIG_MTP = CONFIG.replace(num_nextn_predict_layers=1)  # the MTP block is one more MoE layer


def _mesh():
    return glmjax.make_mesh(expert=4, tensor=2)


def _logits(model, ids):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids).logits)(state, ids))


def _expert_stacks(model):
    blocks = list(model.layers) + [model.mtp.block]
    return [getattr(b.mlp.experts, p) for b in blocks if hasattr(b.mlp, "experts") for p in ("gate", "up", "down")]


def _assert_same_values(a, b):
    for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoint")
    glmjax.save_pretrained(glmjax.init_model(CONFIG_MTP, seed=0), path)
    return path, glmjax.from_pretrained(path)


@pytest.fixture(scope="module")
def sharded(checkpoint):
    mesh = _mesh()
    with sharding.use_mesh(mesh):
        return mesh, glmjax.from_pretrained(checkpoint[0], mesh=mesh)


def test_every_parameter_is_in_the_sharding_the_rules_give(sharded):
    mesh, model = sharded
    abstract = nnx.state(nnx.eval_shape(lambda: glmjax.init_model(CONFIG_MTP)))
    expected = nnx.to_flat_state(sharding.param_shardings(abstract, mesh))
    got = nnx.to_flat_state(nnx.state(model))
    assert [p for p, _ in got] == [p for p, _ in expected]
    for (path, var), (_, want) in zip(got, expected):
        assert var[...].sharding == want, path
    stacks = _expert_stacks(model)
    assert len(stacks) == 3 * 4  # layers 1-3 and the MTP block
    for stack in stacks:
        x = stack[...]
        assert x.sharding.spec[0] == "expert"
        assert {s.data.shape[0] for s in x.addressable_shards} == {CONFIG.n_routed_experts // 4}
    assert model.layers[0].attn.q_b[...].sharding.spec == jax.sharding.PartitionSpec("expert", "tensor", None)


def test_sharded_load_matches_one_device(checkpoint, sharded):
    _, one = checkpoint
    mesh, model = sharded
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, 16))
    expected = _logits(one, ids)
    with sharding.use_mesh(mesh):
        got = _logits(model, ids)
    assert np.abs(got - expected).max() <= 1e-5


def test_fused_experts_load_sharded(tmp_path, checkpoint, sharded):
    """transformers' in-memory layout (gate_up_proj [E, 2F, D], down_proj [E, D, F]) read per shard."""
    path, _ = checkpoint
    mesh, model = sharded
    tensors = load_file(path / "model.safetensors")
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in range(CONFIG_MTP.num_hidden_layers + 1):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" in tensors:
            e = range(CONFIG.n_routed_experts)
            fused[p + "gate_up_proj"] = np.stack([np.concatenate(
                [tensors[f"{p}{k}.gate_proj.weight"], tensors[f"{p}{k}.up_proj.weight"]]) for k in e])
            fused[p + "down_proj"] = np.stack([tensors[f"{p}{k}.down_proj.weight"] for k in e])
    save_file(fused, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with sharding.use_mesh(mesh):
        loaded = glmjax.from_pretrained(tmp_path, mesh=mesh)
    _assert_same_values(loaded, model)


def test_a_process_reads_only_the_slices_its_devices_hold(checkpoint, monkeypatch):
    """One simulated process of two: it builds only the shards of its 4 devices (expert
    positions 0 and 1, both tensor positions), so it holds experts 0-3 of 8 and half of
    every dimension split over `expert`."""
    path, one = checkpoint
    mesh = _mesh()
    local = set(mesh.devices[:, :, :, :2].flat)
    reads = []
    read = safetensors_io.Reader.read

    def recording_read(self, name, index):
        reads.append((name, index))
        return read(self, name, index)

    def local_shards_only(shape, placement, callback):
        for device, index in placement.devices_indices_map(shape).items():
            if device in local:
                callback(index)
        return jax.ShapeDtypeStruct(shape, np.float32)

    monkeypatch.setattr(safetensors_io.Reader, "read", recording_read)
    monkeypatch.setattr(jax, "make_array_from_callback", local_shards_only)
    glmjax.from_pretrained(path, mesh=mesh)

    experts = {int(name.split(".")[5]) for name, _ in reads if ".mlp.experts." in name}
    assert experts == {0, 1, 2, 3}
    read_bytes = 4 * sum(math.prod(s.stop - s.start for s in index) for _, index in reads)  # fp32
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(one)))
    assert read_bytes <= 0.55 * total  # half, and kv_b_proj once for W_UK and once for W_UV


def test_save_a_sharded_model_and_reload(tmp_path, checkpoint, sharded):
    _, one = checkpoint
    _, model = sharded
    glmjax.save_pretrained(model, tmp_path, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_same_values(glmjax.from_pretrained(tmp_path), one)


def test_writer_rejects_a_value_unlike_its_header(tmp_path):
    entries = [safetensors_io.Entry("w", (2, 3), np.dtype(np.float32))]
    with pytest.raises(ValueError, match=r"'w' is float32\[3, 2\], its header says float32\[2, 3\]"):
        safetensors_io.write(str(tmp_path), entries, [np.zeros((3, 2), np.float32)], max_file_bytes=2**20)
