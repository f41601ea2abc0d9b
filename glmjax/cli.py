"""`glmjax-train`: train a preset on the synthetic corpus, then check what it generates.

    glmjax-train --config configs/tiny.py --workdir /tmp/glmjax-tiny
    glmjax-train --config configs/tiny.py --workdir /tmp/glmjax-tiny --config.train.steps=100

Every `--config.a.b=value` overrides a field of the config file's ConfigDict. The job
trains `train.steps` steps (DSA stage `train.indexer_stage`, default "sparse": the
indexer learns its KL beside the LM loss), prints the held-out loss before and after,
greedily continues a few held-out prompts and counts the generated tokens that obey the
corpus's rule, then writes `summary.json` and the checkpoint (`model/`) to the workdir.

A mistyped command line (a missing config file, an unknown or ill-typed override, a model
field ModelConfig rejects, a workdir that cannot be a directory) ends before any work with
the usage line and one `glmjax-train: error: ...` naming what is wrong, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp

import glmjax
from glmjax import distributed, presets, sharding, train

EVAL_SEQUENCES = 64
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 8, 32


def make_parser(description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    """The `glmjax-train` command line: --config, --workdir and `--config.a.b=value` overrides."""
    parser = argparse.ArgumentParser(prog="glmjax-train", description=description, allow_abbrev=False)
    parser.add_argument("--config", required=True, help="a config file, optionally `path:arg` for get_config(arg)")
    parser.add_argument("--workdir", required=True, help="where summary.json, metrics and checkpoints are written")
    return parser


def load_job(parser: argparse.ArgumentParser, argv=None, check=None):
    """(config, args) from a command line, or `parser.error` (exit status 2) naming the
    argument, file or field that is wrong: a missing config file, a get_config that rejects
    its `path:arg`, an unknown or ill-typed override, a model field ModelConfig rejects, a
    ValueError from `check(config)` (the job's own checks). Touches no file: `job_config`
    adds the workdir; `glmjax-aot` (glmjax/aot.py) needs none."""
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--config.") and "=" in o)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides are written --config.a.b=value")
    path, _, arg = args.config.partition(":")
    try:
        cfg = presets.load_config(path, overrides, arg or None)
    except FileNotFoundError as err:
        parser.error(f"--config: {err}")
    except ValueError as err:  # get_config's own rejections and the overrides'
        parser.error(f"--config {args.config}: {err}")
    if "model" not in cfg and check is None:
        parser.error(f"--config {args.config}: the config has no `model` section")
    try:
        if check is None:
            presets.model_config_from(cfg)
        else:  # the job reads its model itself (from `model`, or from a checkpoint it names)
            check(cfg)
    except (TypeError, ValueError) as err:
        parser.error(f"--config {args.config}: {err}")
    args.overrides = overrides
    return cfg, args


def job_config(parser: argparse.ArgumentParser, argv=None, check=None):
    """`load_job`'s (config, args), and the workdir: `parser.error` when it is a file or
    cannot be created; it is created only once the config passes."""
    cfg, args = load_job(parser, argv, check)
    if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
        parser.error(f"--workdir {args.workdir} is a file, not a directory")
    try:
        os.makedirs(args.workdir, exist_ok=True)
    except OSError as err:
        parser.error(f"--workdir {args.workdir} cannot be created: {err.strerror or err}")
    if not os.access(args.workdir, os.W_OK | os.X_OK):
        parser.error(f"--workdir {args.workdir} is not writable")
    return cfg, args


def train_main(argv=None) -> dict:
    """The job for a command line (the module docstring)."""
    cfg, args = job_config(make_parser(), argv, check=check_config)
    return run(cfg, args.workdir)


def check_config(cfg) -> None:
    """Raises ValueError when the config has no `train` section, or a mesh or rule it cannot use."""
    if "train" not in cfg:
        raise ValueError("the config has no `train` section (steps, batch_size, seq_len, ...)")
    distributed.check_job(cfg)


def run(cfg, workdir: str) -> dict:
    """Trains the config's model on the synthetic corpus; returns the summary. With
    `config.mesh` (glmjax/distributed.py) the model is created sharded by the rules and
    every batch is a global array split by rows over the batch axes."""
    mesh, rules = distributed.job_mesh(cfg)
    if mesh is None:
        return _run(cfg, workdir, None)
    with sharding.use_mesh(mesh, rules):
        return _run(cfg, workdir, mesh)


def _run(cfg, workdir: str, mesh) -> dict:
    model_cfg, tc = presets.model_config_from(cfg), cfg.train
    stage = tc.get("indexer_stage", "sparse")
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    corpus = train.synthetic_corpus(model_cfg.vocab_size, tc.seq_len, tc.steps * tc.batch_size + EVAL_SEQUENCES,
                                    tc.seed)
    held_out = corpus.tokens[-EVAL_SEQUENCES:]
    eval_batch = distributed.global_batch(
        {"input_ids": jnp.asarray(held_out), "loss_mask": jnp.ones(held_out.shape, jnp.float32)}, mesh)
    where = distributed.describe(mesh) if mesh is not None else jax.devices()[0].platform
    print(f"{model_cfg.num_hidden_layers} layers, hidden {model_cfg.hidden_size}, "
          f"{glmjax.count_params(model_cfg):,} parameters; {where}")
    print(f"corpus: chance loss ln({model_cfg.vocab_size}) = {math.log(model_cfg.vocab_size):.3f}, "
          f"floor {corpus.entropy:.3f}")

    model = glmjax.init_model(model_cfg, tc.seed, mesh=mesh)
    optimizer = train.make_optimizer(tc, model, trainable=train.TRAINABLE[stage])
    kw = dict(mtp_weight=tc.mtp_loss_weight, indexer_stage=stage)
    initial = float(train.eval_step(model, eval_batch, **kw)["lm_loss"])
    print(f"held-out LM loss before: {initial:.3f}")
    start = time.perf_counter()
    stream = (distributed.global_batch(b, mesh) for b in
              train.batches(corpus.tokens[:-EVAL_SEQUENCES], tc.batch_size, tc.seed))
    history = train.fit(model, optimizer, stream, tc.steps, desc=f"train ({stage or 'dense'})", **kw)
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
