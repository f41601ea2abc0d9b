"""`glmjax-train`: train a preset on the synthetic corpus, then check what it generates.

    glmjax-train --config configs/tiny.py --workdir /tmp/glmjax-tiny
    glmjax-train --config configs/tiny.py --workdir /tmp/glmjax-tiny --config.train.steps=100

Every `--config.a.b=value` overrides a field of the config file's ConfigDict. The job
trains `train.steps` steps (DSA stage `train.indexer_stage`, default "sparse": the
indexer learns its KL beside the LM loss), prints the held-out loss before and after,
greedily continues a few held-out prompts and counts the generated tokens that obey the
corpus's rule, then writes `summary.json` and the checkpoint (`model/`) to the workdir.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp

import glmjax
from glmjax import presets, train

EVAL_SEQUENCES = 64
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 8, 32


def _parse(argv):
    parser = argparse.ArgumentParser(prog="glmjax-train", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="a config file, optionally `path:arg` for get_config(arg)")
    parser.add_argument("--workdir", required=True, help="where summary.json and model/ are written")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--config.") and "=" in o)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides are written --config.a.b=value")
    return args, overrides


def train_main(argv=None) -> dict:
    args, overrides = _parse(argv)
    path, _, arg = args.config.partition(":")
    cfg = presets.load_config(path, overrides, arg or None)
    model_cfg, tc = presets.model_config_from(cfg), cfg.train
    stage = tc.get("indexer_stage", "sparse")
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    corpus = train.synthetic_corpus(model_cfg.vocab_size, tc.seq_len, tc.steps * tc.batch_size + EVAL_SEQUENCES,
                                    tc.seed)
    held_out = corpus.tokens[-EVAL_SEQUENCES:]
    eval_batch = {"input_ids": jnp.asarray(held_out), "loss_mask": jnp.ones(held_out.shape, jnp.float32)}
    print(f"{model_cfg.num_hidden_layers} layers, hidden {model_cfg.hidden_size}, "
          f"{glmjax.count_params(model_cfg):,} parameters; {jax.devices()[0].platform}")
    print(f"corpus: chance loss ln({model_cfg.vocab_size}) = {math.log(model_cfg.vocab_size):.3f}, "
          f"floor {corpus.entropy:.3f}")

    model = glmjax.init_model(model_cfg, tc.seed)
    optimizer = train.make_optimizer(tc, model, trainable=train.TRAINABLE[stage])
    kw = dict(mtp_weight=tc.mtp_loss_weight, indexer_stage=stage)
    initial = float(train.eval_step(model, eval_batch, **kw)["lm_loss"])
    print(f"held-out LM loss before: {initial:.3f}")
    start = time.perf_counter()
    history = train.fit(model, optimizer, train.batches(corpus.tokens[:-EVAL_SEQUENCES], tc.batch_size, tc.seed),
                        tc.steps, desc=f"train ({stage or 'dense'})", **kw)
    wall = time.perf_counter() - start
    final = float(train.eval_step(model, eval_batch, **kw)["lm_loss"])
    print(f"held-out LM loss after {tc.steps} steps: {final:.3f} (train loss {history[0]:.3f} -> "
          f"{history[-1]:.3f}, {wall:.1f} s)")

    prompts = held_out[:PROMPTS, :PROMPT_LEN]
    generated = jax.device_get(glmjax.generate(model, prompts, NEW_TOKENS, temperature=0.0))
    accuracy = train.rule_accuracy(corpus, generated, start=PROMPT_LEN)
    print(f"generated tokens that follow the corpus rule: {accuracy:.1%} (chance "
          f"{corpus.successors.shape[1] / model_cfg.vocab_size:.1%})")
    for row in generated[:2]:
        print("  ", " ".join(map(str, row[:PROMPT_LEN])), "|", " ".join(map(str, row[PROMPT_LEN:])))

    summary = {"initial_loss": initial, "final_loss": final, "steps": tc.steps, "wall_seconds": wall,
               "generation_accuracy": accuracy, "chance_loss": math.log(model_cfg.vocab_size),
               "loss_floor": corpus.entropy, "indexer_stage": stage}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    glmjax.save_pretrained(model, workdir / "model")
    print(f"wrote {workdir / 'summary.json'} and {workdir / 'model'}")
    return summary


if __name__ == "__main__":
    train_main()
