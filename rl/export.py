"""The policy as a Hugging Face directory: what a post-training job gives back.

    export(policy, workdir/export/step_40, tokenizer_from=cfg.base.checkpoint)

writes config.json and safetensors (glmjax/hf.py: save_pretrained, gathered one tensor at a
time, process 0 writing) and copies the starting checkpoint's tokenizer files, chat
template and generation config beside them, so that transformers (`AutoTokenizer`,
`AutoModelForCausalLM`) and `glmjax-serve --checkpoint` load the directory as they loaded
the checkpoint. The directory is written under a temporary name and renamed when complete:
a run killed while exporting leaves no half-written model under the final name.
"""

from __future__ import annotations

import os
import shutil

import glmjax
from glmjax import distributed

# What a checkpoint directory holds besides its model: tokenizers' own files, whichever kind.
_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def tokenizer_files(checkpoint: str) -> list[str]:
    """The checkpoint's files that are not the model's weights or config: tokenizer,
    special tokens, chat template, generation config."""
    return sorted(name for name in os.listdir(checkpoint)
                  if os.path.isfile(os.path.join(checkpoint, name)) and name not in _MODEL_FILES
                  and not name.endswith(".safetensors") and not name.startswith("."))


def export(policy: glmjax.GlmForCausalLM, path: str, tokenizer_from: str = "") -> str:
    """Writes `path` (module docstring); every process calls it (the gathers are collective)."""
    partial = path + ".partial"
    if distributed.is_main() and os.path.exists(partial):
        shutil.rmtree(partial)
    glmjax.save_pretrained(policy, partial)
    if distributed.is_main():
        for name in tokenizer_files(tokenizer_from) if tokenizer_from else ():
            shutil.copy2(os.path.join(tokenizer_from, name), os.path.join(partial, name))
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(partial, path)
    return path
