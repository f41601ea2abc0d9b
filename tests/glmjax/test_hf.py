"""glmjax against transformers (>= 5.24): logits, greedy generation, checkpoint round trips."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import glmjax
from tests import hf_models

SEQ = 24  # > index_topk (8): the indexer's selection matters


def _ids(seed, batch=2, length=SEQ):
    return np.random.default_rng(seed).integers(0, hf_models.COMMON["vocab_size"], (batch, length))


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def hf_pair(request, tmp_path_factory):
    build = hf_models.glm_model if request.param == "glm_moe_dsa" else hf_models.deepseek_model
    hf = build(seed=0)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, glmjax.from_pretrained(path), path


def test_config_matches_reference(hf_pair):
    hf, model, _ = hf_pair
    c = model.config
    assert c.model_type == hf.config.model_type
    assert c.index_topk < SEQ
    if c.model_type == "glm_moe_dsa":
        assert c.indexer_types == ("full", "shared", "full", "shared")
    else:
        assert c.n_group > 1 and c.rope["rope_type"] == "yarn"
    assert c.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")


def test_logits_match_transformers(hf_pair):
    hf, model, _ = hf_pair
    ids = _ids(1)
    # fp32 activations of the two implementations differ by ~1e-6; a selection gap well
    # above that cannot flip, so both pick the same keys and experts.
    margins = hf_models.selection_margins(model, ids)
    assert margins["indexer"] > 2e-5, f"indexer top-k near a tie: {margins}"
    assert margins["router"] > 2e-5, f"router top-k near a tie: {margins}"
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    out = np.asarray(model(jnp.asarray(ids)).logits)
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= 1e-4


def test_greedy_generation_matches_transformers(hf_pair):
    hf, model, _ = hf_pair
    prompt = _ids(2, length=8)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                          max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    ours = np.asarray(glmjax.generate(model, prompt, 16))
    assert ref.shape == ours.shape == (2, 24)
    np.testing.assert_array_equal(ours, ref)


def test_glmjax_to_transformers_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    config = glmjax.ModelConfig.from_hf(hf_models.glm_model().config.to_dict())
    model = glmjax.init_model(config.replace(initializer_range=0.1), seed=3)
    for layer in model.layers:  # non-zero correction biases survive the trip
        if hasattr(layer.mlp, "router"):
            bias = layer.mlp.router.e_score_correction_bias
            bias.set_value(jax.random.normal(jax.random.key(7), bias.shape) * 0.1)
    glmjax.save_pretrained(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(4)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(ids)).logits) - ref).max() <= 1e-4
    again = glmjax.from_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, glmjax_state(model))),
                    jax.tree.leaves(jax.tree.map(np.asarray, glmjax_state(again)))):
        np.testing.assert_array_equal(a, b)


def glmjax_state(model):
    from flax import nnx

    return nnx.state(model)


def test_mtp_layer_round_trip(tmp_path):
    config = glmjax.ModelConfig.from_hf(hf_models.glm_model().config.to_dict(), num_nextn_predict_layers=1)
    model = glmjax.init_model(config, seed=5)
    glmjax.save_pretrained(model, tmp_path)
    names = json.load(open(tmp_path / "config.json"))
    assert names["num_nextn_predict_layers"] == 1
    loaded = glmjax.from_pretrained(tmp_path)
    assert loaded.mtp is not None
    ids = jnp.asarray(_ids(5))
    h = model(ids).hidden
    a = model.mtp_forward(h[:, :-1], ids[:, 1:]).logits
    b = loaded.mtp_forward(h[:, :-1], ids[:, 1:]).logits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_and_fused_expert_checkpoints(tmp_path, hf_pair):
    hf, model, path = hf_pair
    from safetensors.numpy import load_file, save_file

    # Sharded with an index.
    glmjax.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=200_000)
    index = json.load(open(tmp_path / "sharded" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    ids = jnp.asarray(_ids(6))
    expected = np.asarray(model(ids).logits)
    np.testing.assert_array_equal(np.asarray(glmjax.from_pretrained(tmp_path / "sharded")(ids).logits), expected)

    # transformers' in-memory layout: experts fused as gate_up_proj [E, 2F, D], down_proj [E, D, F].
    tensors = load_file(os.path.join(path, "model.safetensors"))
    fused, c = {}, model.config
    for name, value in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = value
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in tensors:
            continue
        e = range(c.n_routed_experts)
        gate_up = np.stack([np.concatenate([tensors[f"{p}{k}.gate_proj.weight"], tensors[f"{p}{k}.up_proj.weight"]])
                            for k in e])
        fused[p + "gate_up_proj"] = gate_up
        fused[p + "down_proj"] = np.stack([tensors[f"{p}{k}.down_proj.weight"] for k in e])
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((path / "config.json").read_text())
    np.testing.assert_array_equal(np.asarray(glmjax.from_pretrained(tmp_path / "fused")(ids).logits), expected)


def _rewrite(src, dst, edit):
    from safetensors.numpy import load_file, save_file

    tensors = edit(load_file(os.path.join(src, "model.safetensors")))
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_checkpoint_errors_name_the_tensor(tmp_path, hf_pair):
    _, _, path = hf_pair
    name = "model.layers.1.self_attn.q_b_proj.weight"

    missing = _rewrite(path, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(glmjax.CheckpointMismatch, match=r"q_b_proj\.weight.*\(160, 48\).*missing"):
        glmjax.from_pretrained(missing)

    def bad_shape(t):
        t[name] = t[name][:-1]
        return t

    with pytest.raises(glmjax.CheckpointMismatch, match=r"q_b_proj\.weight.*\(159, 48\).*expected \(160, 48\)"):
        glmjax.from_pretrained(_rewrite(path, tmp_path / "shape", bad_shape))

    def extra(t):
        t["model.layers.0.self_attn.surprise.weight"] = np.ones(3, np.float32)
        return t

    with pytest.raises(glmjax.CheckpointMismatch, match="surprise"):
        glmjax.from_pretrained(_rewrite(path, tmp_path / "extra", extra))


def test_bfloat16_load_tracks_float32(hf_pair):
    _, model, path = hf_pair
    bf16 = glmjax.from_pretrained(path, dtype="bfloat16")
    assert bf16.layers[0].attn.q_a[...].dtype == jnp.bfloat16
    assert bf16.layers[1].mlp.router.weight[...].dtype == jnp.float32  # the router stays fp32
    ids = jnp.asarray(_ids(8))
    a, b = np.asarray(model(ids).logits), np.asarray(bf16(ids).logits)
    # bf16 keeps ~3 significant digits; a wrong layout would be off by O(1).
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99
