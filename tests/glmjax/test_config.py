"""ModelConfig against transformers' GlmMoeDsaConfig / DeepseekV32Config, and the presets.

Only configs are built here (plus one tiny HF attention layer for its softmax scale), so
the file runs in seconds; full-size models are shape-checked elsewhere with eval_shape.
"""

import dataclasses
import pathlib
import re

import pytest
import transformers

from glmjax.config import ModelConfig
from glmjax.presets import load_config, model_config_dict, model_config_from

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
PRESETS = ("glm5", "glm53", "deepseek_v32", "tiny", "small")
FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
               "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace",
               "index_topk", "index_n_heads", "index_head_dim", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings")

# Small enough to build HF attention layers in milliseconds.
TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
               num_experts_per_tok=2, n_group=1, topk_group=1, index_topk=16, index_n_heads=4,
               index_head_dim=16, max_position_embeddings=512)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def preset(name, overrides=()):
    return model_config_from(load_config(CONFIGS / f"{name}.py", overrides))


# Per-layer types ----------------------------------------------------------------------
@pytest.mark.parametrize("layers,freq,offset", [
    (78, 1, 2), (78, 4, 3), (12, 2, 1), (12, 3, 2), (9, 4, 1), (10, 4, 5), (6, 0, 2),
])
def test_indexer_types_follow_transformers_rule(layers, freq, offset):
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=layers, index_topk_freq=freq, index_skip_topk_offset=offset)
    ours = ModelConfig(num_hidden_layers=layers, index_topk_freq=freq, index_skip_topk_offset=offset)
    assert ours.indexer_types == tuple(hf.indexer_types)


@pytest.mark.parametrize("pattern", ["FSFS", "FSSSFSSS", "FFSF", "F"])
def test_indexer_pattern_follows_transformers(pattern):
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=len(pattern), index_topk_pattern=pattern)
    ours = ModelConfig(num_hidden_layers=len(pattern), first_k_dense_replace=1, index_topk_pattern=pattern)
    assert ours.indexer_types == tuple(hf.indexer_types)


def test_glm53_shares_indices_on_all_but_21_layers():
    cfg = preset("glm53")
    full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    assert full == [0, 1, 2, *range(6, 75, 4)]
    assert len(full) == 21 and full[-1] == 74
    assert cfg.has_indexer(6) and not cfg.has_indexer(7)
    assert cfg.rope == {"rope_theta": 8e6, "rope_type": "default"}
    assert cfg.max_position_embeddings == 1048576


@pytest.mark.parametrize("name", ["glm5", "deepseek_v32"])
def test_full_size_presets_run_the_indexer_everywhere(name):
    assert set(preset(name).indexer_types) == {"full"}


def test_mlp_layer_types():
    glm5 = preset("glm5")
    assert glm5.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 75
    assert not glm5.is_moe(2) and glm5.is_moe(3)
    assert preset("tiny").mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=5, first_k_dense_replace=2)
    assert ModelConfig(num_hidden_layers=5, first_k_dense_replace=2).mlp_layer_types == tuple(hf.mlp_layer_types)
    # Derived lists follow the fields they derive from; explicit ones are kept.
    assert glm5.replace(num_hidden_layers=4).mlp_layer_types == ("dense",) * 3 + ("sparse",)
    mixed = ("dense", "sparse", "dense", "sparse")
    assert ModelConfig(num_hidden_layers=4, mlp_layer_types=list(mixed)).mlp_layer_types == mixed


# Hugging Face config.json ---------------------------------------------------------------
def test_from_hf_to_hf_round_trip_glm(tmp_path):
    hf = transformers.GlmMoeDsaConfig(**TINY_HF, num_hidden_layers=6, first_k_dense_replace=2,
                                      index_topk_freq=2, index_skip_topk_offset=1, num_nextn_predict_layers=1,
                                      rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    for name in set(FIELDS) & set(hf.to_dict()) - {"rope_parameters", "dtype", "param_dtype", "kernel_impl"}:
        expected = getattr(hf, name)
        assert getattr(cfg, name) == (tuple(expected) if isinstance(expected, list) else expected), name
    assert cfg.rope == hf.rope_parameters
    assert cfg.indexer_types == ("full", "shared", "full", "shared", "full", "shared")
    assert cfg.num_nextn_predict_layers == 1

    d = cfg.to_hf()
    back = transformers.GlmMoeDsaConfig(**d)
    assert back.indexer_types == list(cfg.indexer_types)
    assert back.mlp_layer_types == list(cfg.mlp_layer_types)
    assert back.rope_parameters == cfg.rope
    assert back.qk_head_dim == cfg.qk_head_dim and back.head_dim == cfg.qk_rope_head_dim
    for name in SIZE_FIELDS:
        assert getattr(back, name) == getattr(cfg, name), name
    assert ModelConfig.from_hf(d) == cfg
    assert not {"param_dtype", "kernel_impl", "moe_capacity_factor"} & d.keys()
    assert d["dtype"] == cfg.param_dtype  # transformers' name for the stored dtype


def test_from_hf_keeps_an_explicit_pattern(tmp_path):
    transformers.GlmMoeDsaConfig(**TINY_HF, num_hidden_layers=4, index_topk_pattern="FSFS").save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path / "config.json")
    assert cfg.indexer_types == ("full", "shared", "full", "shared")
    assert transformers.GlmMoeDsaConfig(**cfg.to_hf()).indexer_types == list(cfg.indexer_types)


def test_from_hf_to_hf_round_trip_deepseek(tmp_path):
    hf = transformers.DeepseekV32Config(**{**TINY_HF, "max_position_embeddings": 163840}, num_hidden_layers=3,
                                        first_k_dense_replace=1, rope_parameters=YARN, rms_norm_eps=1e-6)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.model_type == "deepseek_v32" and not cfg.indexer_rope_interleaved
    assert cfg.rope == hf.rope_parameters == YARN
    assert cfg.indexer_types == ("full",) * 3
    for name in SIZE_FIELDS:
        assert getattr(cfg, name) == getattr(hf, name), name

    d = cfg.to_hf()
    assert "indexer_types" not in d and d["architectures"] == ["DeepseekV32ForCausalLM"]
    back = transformers.DeepseekV32Config(**d)
    assert back.rope_parameters == YARN
    assert back.mlp_layer_types == list(cfg.mlp_layer_types)
    for name in SIZE_FIELDS:
        assert getattr(back, name) == getattr(cfg, name), name
    assert ModelConfig.from_hf(d) == cfg


@pytest.mark.parametrize("name,hf_class", [("glm5", transformers.GlmMoeDsaConfig),
                                           ("deepseek_v32", transformers.DeepseekV32Config)])
def test_full_size_presets_match_transformers_defaults(name, hf_class):
    """transformers' config classes default to the released checkpoints' sizes."""
    cfg = preset(name)
    reference, exported = hf_class(), hf_class(**cfg.to_hf())
    for field in SIZE_FIELDS:
        assert getattr(cfg, field) == getattr(reference, field) == getattr(exported, field), field
    assert exported.rope_parameters == cfg.rope
    assert exported.mlp_layer_types == list(cfg.mlp_layer_types)


def test_from_hf_rejects_other_models():
    with pytest.raises(ValueError, match="model_type='llama'"):
        ModelConfig.from_hf({"model_type": "llama"})


# Validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("model_type", "llama"),
    ("hidden_size", 0),
    ("n_group", 3),          # does not divide 8 experts
    ("topk_group", 2),       # more than n_group=1
    ("num_experts_per_tok", 9),
    ("num_key_value_heads", 2),
    ("qk_rope_head_dim", 7),
    ("index_head_dim", 4),   # narrower than the rope dims it rotates
    ("index_topk_pattern", "FXSF"),
    ("indexer_types", ("shared", "full", "full", "full")),
    ("mlp_layer_types", ("dense", "sparse")),
    ("num_nextn_predict_layers", 2),
    ("rope_parameters", {"rope_type": "ntk", "rope_theta": 1e4}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 64}),
    ("hidden_act", "gelu"),
    ("dtype", "float16"),
    ("kernel_impl", "cuda"),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=re.escape(f"ModelConfig.{field}=")):
        preset("tiny").replace(**{field: value})


def test_groups_need_two_experts_each():
    with pytest.raises(ValueError, match="n_group"):
        preset("tiny").replace(n_group=8, topk_group=8)


def test_layer_zero_must_run_the_indexer():
    with pytest.raises(ValueError, match="indexer_types"):
        ModelConfig(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=0)


def test_config_is_frozen_and_hashable():
    cfg = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1
    assert hash(cfg) == hash(preset("tiny"))


# Softmax scale --------------------------------------------------------------------------
@pytest.mark.parametrize("model_type,rope", [
    ("deepseek_v32", YARN),
    ("glm_moe_dsa", YARN),
    ("deepseek_v32", {**YARN, "mscale_all_dim": 0.707, "factor": 16.0}),
    ("glm_moe_dsa", {"rope_type": "default", "rope_theta": 1e6}),
])
def test_softmax_scale_matches_transformers_attention(model_type, rope):
    from transformers.models.deepseek_v32 import modeling_deepseek_v32
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

    hf_class, attention = {
        "deepseek_v32": (transformers.DeepseekV32Config, modeling_deepseek_v32.DeepseekV32Attention),
        "glm_moe_dsa": (transformers.GlmMoeDsaConfig, modeling_glm_moe_dsa.GlmMoeDsaAttention),
    }[model_type]
    hf = hf_class(**{**TINY_HF, "max_position_embeddings": 163840}, num_hidden_layers=2, rope_parameters=rope)
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert cfg.softmax_scale == pytest.approx(attention(hf, layer_idx=0).scaling, rel=1e-12)
    if rope["rope_type"] == "yarn":
        m = 0.1 * rope["mscale_all_dim"] * __import__("math").log(rope["factor"]) + 1.0
        assert cfg.softmax_scale == pytest.approx(cfg.qk_head_dim ** -0.5 * m * m, rel=1e-12)


def test_deepseek_preset_softmax_scale():
    cfg = preset("deepseek_v32")
    m = 0.1 * __import__("math").log(40.0) + 1.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)


# Presets and overrides ----------------------------------------------------------------
@pytest.mark.parametrize("name", PRESETS)
def test_presets_hold_every_model_field(name):
    config = load_config(CONFIGS / f"{name}.py")
    assert set(config.model.keys()) == set(FIELDS)
    assert f"configs/{name}.py" in (CONFIGS / f"{name}.py").read_text().split('"""')[1], "docstring names its command"
    model_config_from(config)


def test_glm5_preset_is_the_modelconfig_default():
    assert preset("glm5") == ModelConfig()


def test_tiny_preset():
    config = load_config(CONFIGS / "tiny.py")
    cfg = model_config_from(config)
    assert cfg.indexer_types == ("full", "shared", "full", "shared")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (64, 4, 8, 2)
    assert config.train.to_dict() == dict(seq_len=64, batch_size=16, steps=300, learning_rate=3e-3, warmup=20,
                                          mtp_loss_weight=0.3, seed=0)


def test_small_preset():
    cfg = preset("small")
    assert cfg.indexer_types == ("full", "shared", "shared", "shared") * 2
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (512, 8, 32, 4)


def test_load_config_overrides_parse_each_type():
    config = load_config(CONFIGS / "tiny.py", [
        "model.num_hidden_layers=2",
        "--config.model.index_topk_pattern=FS",
        "model.routed_scaling_factor=3",
        "model.tie_word_embeddings=true",
        "model.dtype=bfloat16",
        "model.rope_parameters.rope_theta=5e5",
        "model.mlp_layer_types=dense,sparse",
        "model.pad_token_id=3",
        "train.steps=100",
        "train.learning_rate=1e-3",
    ])
    assert config.train.steps == 100 and isinstance(config.train.steps, int)
    assert config.train.learning_rate == 1e-3
    cfg = model_config_from(config)
    assert cfg.num_hidden_layers == 2 and cfg.indexer_types == ("full", "shared")
    assert cfg.routed_scaling_factor == 3.0 and isinstance(cfg.routed_scaling_factor, float)
    assert cfg.tie_word_embeddings is True and cfg.dtype == "bfloat16" and cfg.pad_token_id == 3
    assert cfg.rope["rope_theta"] == 5e5
    assert cfg.mlp_layer_types == ("dense", "sparse")
    listed = load_config(CONFIGS / "tiny.py", ["model.mlp_layer_types=['dense', 'dense', 'sparse', 'sparse']"])
    assert model_config_from(listed).mlp_layer_types == ("dense", "dense", "sparse", "sparse")


def test_load_config_rejects_an_unknown_key():
    with pytest.raises(ValueError, match=r"'model.hiden_size'.*hidden_size"):
        load_config(CONFIGS / "tiny.py", ["model.hiden_size=128"])
    with pytest.raises(ValueError, match=r"'trian.steps'.*distributed, mesh, model, rules, train"):
        load_config(CONFIGS / "tiny.py", ["trian.steps=1"])


@pytest.mark.parametrize("override", ["model.hidden_size=big", "model.hidden_size=2.5",
                                      "model.tie_word_embeddings=maybe", "model.hidden_size"])
def test_load_config_rejects_a_bad_value(override):
    with pytest.raises(ValueError, match="model.hidden_size|model.tie_word_embeddings"):
        load_config(CONFIGS / "tiny.py", [override])


def test_model_config_from_rejects_an_unknown_field():
    with pytest.raises(ValueError, match="hiden_size"):
        model_config_from({"model": {"hiden_size": 1}})
    with pytest.raises(ValueError, match="hiden_size"):
        model_config_dict(hiden_size=1)
