"""`glmjax-train`: the main job for a config file.

    glmjax-train --config configs/sao_tiny.py --workdir /tmp/sao       # SAO post-training
    glmjax-train --config configs/tiny.py --workdir /tmp/lm            # language-model training
    glmjax-train --config configs/sao_tiny.py --workdir /tmp/sao --config.rl.eta=2
    glmjax-train --config configs/opd_tiny.py --workdir /tmp/opd       # multi-teacher distillation

A config with an `rl` section runs the RL loop (rl/trainer.py); one with an `opd` section
the on-policy distillation job (rl/opd_trainer.py); one with only `model` and `train`
trains the language model (glmjax/cli.py). `--config.a.b=value` overrides a field.

Compiled programs are kept in a persistent JAX cache ($GLMJAX_JAX_CACHE, default
~/.cache/glmjax/jax), so a second run of a job skips the compiles of the first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import jax

from glmjax import cli as lm_cli
from glmjax import presets

CACHE = os.environ.get("GLMJAX_JAX_CACHE", os.path.expanduser("~/.cache/glmjax/jax"))


def use_compile_cache(path: str = CACHE) -> None:
    """Persists every compile that takes over half a second under `path`."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv=None) -> int:
    """The `glmjax-train` command: runs the job and exits 0 (its figures are in the workdir's summary.json)."""
    run(argv)
    return 0


def run(argv=None) -> dict:
    """The job the arguments name; returns its summary."""
    parser = argparse.ArgumentParser(prog="glmjax-train", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="a config file, optionally `path:arg` for get_config(arg)")
    parser.add_argument("--workdir", required=True)
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--config.") and "=" in o)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides are written --config.a.b=value")
    use_compile_cache()
    path, _, arg = args.config.partition(":")
    cfg = presets.load_config(path, overrides, arg or None)
    if "opd" in cfg:
        logging.basicConfig(level=logging.WARNING)
        from rl import opd_trainer

        return opd_trainer.run(cfg, args.workdir)
    if "rl" not in cfg:
        return lm_cli.train_main(argv)
    logging.basicConfig(level=logging.WARNING)
    from rl import trainer

    return trainer.run(cfg, args.workdir)


if __name__ == "__main__":
    sys.exit(main())
