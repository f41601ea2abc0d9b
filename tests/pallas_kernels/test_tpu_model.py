"""The whole model through the Mosaic TPU kernels (TPU interpret mode on this CPU) against
transformers: GLMJAX_PALLAS_BACKEND=tpu-interpret makes kernel_impl="pallas" run
pallas_kernels/tpu/ for every attention op (dense MLA, the indexer, sparse MLA)."""

import importlib

import jax.numpy as jnp
import numpy as np
import torch

import glmjax
from tests import hf_models

SEQ = 12  # > index_topk (8): the first layers select, the shared ones reuse it


def test_tpu_kernels_give_transformers_logits(tmp_path, monkeypatch):
    """GLM-5's tiny model (IndexShare: full and shared indexer layers, MoE, MLA)."""
    hf = hf_models.glm_model(seed=0)
    hf.save_pretrained(tmp_path)
    monkeypatch.setenv("GLMJAX_PALLAS_BACKEND", "tpu-interpret")
    calls = []
    for module, name in (("mla", "mla_attention"), ("indexer", "indexer_topk"), ("sparse_mla", "sparse_mla_attention")):
        mod = importlib.import_module(f"pallas_kernels.tpu.{module}")
        kernel = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _k=kernel, _n=name, **kw: calls.append((_n, kw["backend"])) or _k(*a, **kw))
    model = glmjax.from_pretrained(tmp_path, kernel_impl="pallas")
    for length in (SEQ, 6):  # sparse (indexer + sparse MLA), then dense MLA (6 keys <= top-k)
        ids = np.random.default_rng(1).integers(0, hf_models.COMMON["vocab_size"], (1, length))
        margins = hf_models.selection_margins(model, ids)
        assert margins["indexer"] > 2e-5 and margins["router"] > 2e-5, margins
        with torch.no_grad():
            ref = hf(torch.tensor(ids)).logits.numpy()
        out = np.asarray(model(jnp.asarray(ids)).logits)
        assert np.abs(out - ref).max() <= 1e-4
    assert {n for n, _ in calls} == {"indexer_topk", "sparse_mla_attention", "mla_attention"}
    assert {b for _, b in calls} == {"tpu-interpret"}
