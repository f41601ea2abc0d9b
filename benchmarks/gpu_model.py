"""The whole model on a GPU with its Pallas kernels (`kernel_impl="pallas"`) beside the jnp
references (`"xla"`): the same weights, logits compared, then prefill, a training step and
greedy decoding timed arm against arm.

    python benchmarks/gpu_model.py --out results/gpu_model.json      # on a GPU: ~3 minutes
    python benchmarks/gpu_model.py --smoke                           # anywhere: the tiny model

The model is `configs/small.py` (~120M parameters, 32 experts, MLA with DSA top-128 and
IndexShare) in bfloat16. Each arm's logits are compared with a float32 run of the
reference path on the same weights, so the kernels' error sits beside the reference's own
bf16 error. The arms are timed alternately, repeat by repeat; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import glmjax
from glmjax.presets import load_config, model_config_from

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import floor  # noqa: E402

ARMS = ("xla", "pallas")


def _models(config: glmjax.ModelConfig) -> dict:
    """The two arms in float32 and in bfloat16, all with the same weights."""
    graphdef, state = nnx.split(glmjax.init_model(config.replace(dtype="float32", param_dtype="float32"), seed=0))
    out = {}
    for dtype in ("float32", "bfloat16"):
        for arm in ARMS:
            g, like = nnx.split(nnx.eval_shape(lambda arm=arm, dtype=dtype: glmjax.init_model(
                config.replace(kernel_impl=arm, dtype=dtype, param_dtype=dtype), seed=0)))
            out[arm, dtype] = nnx.merge(g, jax.tree.map(lambda x, l: x.astype(l.dtype), state, like))
    return out


def _forward(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda ids: nnx.merge(graphdef, state)(ids).logits)


def _train_step(model):
    """Gradient of next-token cross-entropy with respect to every parameter."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, ids):
        logits = nnx.merge(graphdef, params, rest)(ids).logits.astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    step = jax.jit(jax.value_and_grad(loss))
    return lambda ids: step(params, ids)


def _interleaved(fns: dict, args: tuple, repeats: int) -> dict:
    """Median seconds per arm, the arms alternating repeat by repeat (first call: compile)."""
    wall = lambda fn: floor.clock(lambda: fn(*args))[0]  # noqa: E731
    compile_s = {arm: wall(fn) for arm, fn in fns.items()}
    times = {arm: [] for arm in fns}
    for _ in range(repeats):
        for arm, fn in fns.items():
            times[arm].append(wall(fn))
    return {arm: {"median_s": statistics.median(t), "first_call_s": compile_s[arm], "repeats": len(t)}
            for arm, t in times.items()}


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _agreement(a, b) -> float:
    return float(jnp.mean(jnp.argmax(a, -1) == jnp.argmax(b, -1)))


def run(prefill_tokens: int, train_tokens: int, decode_batch: int, prompt: int, new_tokens: int,
        repeats: int, smoke: bool = False, config_file: str = "configs/small.py") -> dict:
    if jax.default_backend() != "gpu" and not smoke:
        raise SystemExit(f"no GPU here (default backend {jax.default_backend()!r}): run with --smoke")
    root = pathlib.Path(__file__).resolve().parent.parent
    config = model_config_from(load_config(root / config_file))
    if prefill_tokens > config.max_position_embeddings:
        config = config.replace(max_position_embeddings=prefill_tokens)
    models = _models(config)
    rng = np.random.default_rng(0)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "model": config_file, "params": glmjax.count_params(config), "dtype": "bfloat16",
              "index_topk": config.index_topk}

    # 1. Logits. In float32 the two arms compute the same function, so they agree to the
    # matmul precision; in bfloat16 rounding flips discrete choices (experts, top-k keys),
    # so each arm is judged by how often its next token matches the float32 one.
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (1, prefill_tokens)), jnp.int32)
    forwards = {key: _forward(m) for key, m in models.items()}
    with jax.default_matmul_precision("highest"):  # float32 without TF32 passes, in XLA and Triton alike
        logits = {key: forwards[key](ids) for key in models if key[1] == "float32"}
    logits |= {key: forwards[key](ids) for key in models if key[1] == "bfloat16"}
    want = logits["xla", "float32"]
    report["f32_logits_rel_err_pallas_vs_xla"] = _rel_err(logits["pallas", "float32"], want)
    report["f32_argmax_agreement_pallas_vs_xla"] = _agreement(logits["pallas", "float32"], want)
    report["bf16_argmax_agreement_vs_f32"] = {arm: _agreement(logits[arm, "bfloat16"], want) for arm in ARMS}
    print({k: v for k, v in report.items() if "agreement" in k or "rel_err" in k}, flush=True)

    # 2. Prefill, one sequence of prefill_tokens.
    report["prefill"] = _interleaved({arm: forwards[arm, "bfloat16"] for arm in ARMS}, (ids,), repeats)
    report["prefill"]["tokens"] = prefill_tokens
    print(f"prefill: {report['prefill']}", flush=True)

    # 3. One training step (forward + backward), one sequence of train_tokens.
    tids = ids[:, :train_tokens]
    report["train_step"] = _interleaved({arm: _train_step(models[arm, "bfloat16"]) for arm in ARMS}, (tids,), repeats)
    report["train_step"]["tokens"] = train_tokens
    print(f"train step: {report['train_step']}", flush=True)

    # 4. Greedy decoding through glmjax.generate.
    prompts = jnp.asarray(rng.integers(0, config.vocab_size, (decode_batch, prompt)), jnp.int32)
    gens = {arm: (lambda p, m=m: glmjax.generate(m, p, new_tokens))
            for arm, m in ((arm, models[arm, "bfloat16"]) for arm in ARMS)}
    out = {arm: np.asarray(fn(prompts))[:, prompt:] for arm, fn in gens.items()}
    same = out["pallas"] == out["xla"]
    first_diff = [int(np.argmin(row)) if not row.all() else new_tokens for row in same]
    report["decode"] = _interleaved(gens, (prompts,), max(2, repeats // 2))
    report["decode"].update(batch=decode_batch, prompt=prompt, new_tokens=new_tokens,
                            greedy_tokens_equal=float(same.mean()), first_difference=first_diff)
    for arm in ARMS:
        report["decode"][arm]["tokens_per_s"] = decode_batch * new_tokens / report["decode"][arm]["median_s"]
    print(f"decode: {report['decode']}", flush=True)
    for key in ("prefill", "train_step", "decode"):
        report[f"{key}_pallas_speedup"] = report[key]["xla"]["median_s"] / report[key]["pallas"]["median_s"]
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--train-tokens", type=int, default=2048)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--config", default="configs/small.py", help="the model's config file")
    parser.add_argument("--smoke", action="store_true",
                        help="anywhere: configs/tiny.py at tiny sizes (interpret mode on a CPU)")
    args = parser.parse_args()
    if args.smoke:
        args.config, args.prefill_tokens, args.train_tokens, args.decode_batch, args.prompt, args.new_tokens = (
            "configs/tiny.py", 48, 48, 2, 16, 4)
        args.repeats = 1
    start = time.perf_counter()
    report = run(args.prefill_tokens, args.train_tokens, args.decode_batch, args.prompt, args.new_tokens,
                 args.repeats, args.smoke, args.config)
    report["seconds"] = time.perf_counter() - start
    print(json.dumps({k: v for k, v in report.items() if k.endswith("speedup")}))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        import results_io  # benchmarks/results_io.py: keeps the file's findings

        results_io.write(args.out, report)


if __name__ == "__main__":
    floor.main_with_profile(main, "gpu_model")  # --profile DIR: a JAX profiler trace of the run
