"""`glmjax-train`: the main job for a config file.

    glmjax-train --config configs/sao_tiny.py --workdir /tmp/sao       # SAO post-training
    glmjax-train --config configs/tiny.py --workdir /tmp/lm            # language-model training
    glmjax-train --config configs/sao_tiny.py --workdir /tmp/sao --config.rl.eta=2
    glmjax-train --config configs/opd_tiny.py --workdir /tmp/opd       # multi-teacher distillation

A config with an `rl` section runs the RL loop (rl/trainer.py); one with an `opd` section
the on-policy distillation job (rl/distill/trainer.py); one with only `model` and `train`
trains the language model (glmjax/cli.py). `--config.a.b=value` overrides a field.

Bad input ends before any work, with the usage line and one `glmjax-train: error: ...`
naming the file, override, field or workdir that is wrong (exit status 2): everything
glmjax/cli.py checks, the job's own typed config (rl/config.py, through
`rl.trainer.check_config` and `rl.distill.trainer.check_config`), and a workdir whose
checkpoints all fail to read. Tracebacks are left for bugs.

Compiled programs are kept in a persistent JAX cache ($GLMJAX_JAX_CACHE, default
~/.cache/glmjax/jax), so a second run of a job skips the compiles of the first.
"""

from __future__ import annotations

import logging
import os
import sys

import jax

from glmjax import cli as lm_cli
from rl.checkpoint import UnreadableCheckpoints

CACHE = os.environ.get("GLMJAX_JAX_CACHE", os.path.expanduser("~/.cache/glmjax/jax"))


def use_compile_cache(path: str = CACHE) -> None:
    """Persists every compile under `path`, the small ones too: a job launch compiles some
    80 programs under half a second each (samplers, casts, GAE helpers), about 4 s that a
    cached launch reads back in 1.5 s."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def main(argv=None) -> int:
    """The `glmjax-train` command: runs the job and exits 0 (its figures are in the workdir's summary.json)."""
    run(argv)
    return 0


def run(argv=None) -> dict:
    """The job the arguments name; returns its summary."""
    parser = lm_cli.make_parser(__doc__.splitlines()[0])
    cfg, args = lm_cli.job_config(parser, argv, check=lambda cfg: _job(cfg).check_config(cfg))
    use_compile_cache()
    logging.basicConfig(level=logging.WARNING)
    try:
        return _job(cfg).run(cfg, args.workdir)
    except UnreadableCheckpoints as err:
        parser.error(f"--workdir {args.workdir}: {err}; move them aside to start afresh")


def _job(cfg):
    """The module of the config's job: `check_config(cfg)` raises ValueError on bad fields,
    `run(cfg, workdir)` runs it."""
    if "opd" in cfg:
        from rl.distill import trainer as opd_trainer

        return opd_trainer
    if "rl" in cfg:
        from rl import trainer

        return trainer
    if "train" in cfg:
        return lm_cli
    if "model" in cfg:  # a model preset (configs/glm5.py, configs/glm53.py): jobs load it, it runs none
        raise ValueError("the config is a model preset with none of the sections `rl` (RL job), `opd` "
                         "(distillation) or `train` (language model): job configs load it, e.g. "
                         "configs/glm53_sao.py (glmjax-train, or glmjax-aot --topology v5p:8x8x4 to compile it "
                         "for a TPU slice; python -m rl.job_plan for its memory plan)")
    raise ValueError("the config has none of the sections `rl` (RL job), `opd` (distillation) or `train` "
                     "(language model)")


if __name__ == "__main__":
    sys.exit(main())
