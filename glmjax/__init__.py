"""glmjax: the GLM-5 model family (MoE + MLA + DSA + IndexShare + MTP) in JAX.

    import glmjax
    model = glmjax.from_pretrained("path/to/GLM-5", dtype="bfloat16")
    logits = model(input_ids).logits                       # [B, T, N]
    tokens = glmjax.generate(model, input_ids, max_new_tokens=32)
"""

from glmjax.cache import KVCache, LayerCache
from glmjax.config import ModelConfig
from glmjax.generate import generate
from glmjax.hf import CheckpointMismatch, from_pretrained, save_pretrained
from glmjax.model import GlmForCausalLM, ModelOutput, count_params, init_model
from glmjax.sharding import make_mesh

__all__ = [
    "CheckpointMismatch",
    "GlmForCausalLM",
    "KVCache",
    "LayerCache",
    "ModelConfig",
    "ModelOutput",
    "count_params",
    "from_pretrained",
    "generate",
    "init_model",
    "make_mesh",
    "save_pretrained",
]
