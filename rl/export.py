"""The policy as a Hugging Face directory: what a post-training job gives back.

    export(policy, workdir/export/step_40, tokenizer_from=cfg.base.checkpoint)

writes config.json and safetensors (glmjax/hf.py: save_pretrained, gathered one tensor at a
time, process 0 writing) and copies the starting checkpoint's tokenizer files, chat
template and generation config beside them, so that transformers (`AutoTokenizer`,
`AutoModelForCausalLM`) and `glmjax-serve --checkpoint` load the directory as they loaded
the checkpoint. The directory is written under a temporary name and renamed when complete:
a run killed while exporting leaves no half-written model under the final name. A remote
`path` (gs://...) is written locally and uploaded once complete, config.json last
(glmjax/storage.py); a remote `tokenizer_from` is read from a local copy.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import glmjax
from glmjax import distributed, storage

# What a checkpoint directory holds besides its model: tokenizers' own files, whichever kind.
_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


@contextlib.contextmanager
def _nothing():
    yield ""


def tokenizer_files(checkpoint: str) -> list[str]:
    """The checkpoint's files that are not the model's weights or config: tokenizer,
    special tokens, chat template, generation config."""
    return sorted(name for name in os.listdir(checkpoint)
                  if os.path.isfile(os.path.join(checkpoint, name)) and name not in _MODEL_FILES
                  and not name.endswith(".safetensors") and not name.startswith("."))


def export(policy: glmjax.GlmForCausalLM, path: str, tokenizer_from: str = "") -> str:
    """Writes `path` (module docstring); every process calls it (the gathers are collective)."""
    if storage.is_remote(path):
        with storage.writing(path) as local:
            os.rmdir(local)
            _export_local(policy, local, tokenizer_from)
        return path
    return _export_local(policy, path, tokenizer_from)


def _export_local(policy: glmjax.GlmForCausalLM, path: str, tokenizer_from: str) -> str:
    partial = path + ".partial"
    if distributed.is_main() and os.path.exists(partial):
        shutil.rmtree(partial)
    glmjax.save_pretrained(policy, partial)
    if distributed.is_main():
        with storage.reading(tokenizer_from) if tokenizer_from else _nothing() as source:
            for name in tokenizer_files(source) if source else ():
                shutil.copy2(os.path.join(source, name), os.path.join(partial, name))
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(partial, path)
    return path
