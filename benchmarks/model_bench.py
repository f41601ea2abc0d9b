"""Prefill, decode and the learner step of glmjax against this machine's floor and against
transformers, same weights, one run.

    python benchmarks/model_bench.py --out results/model_bench.json [--profile DIR]

The model is configs/small.py with random weights, written by glmjax.save_pretrained and
read by transformers' AutoModelForCausalLM, so both run identical parameters in fp32.
  * prefill: batch 4 x 512 tokens, the forward that writes the KV cache and gives the next
    token's logits (glmjax's logits_at, transformers' logits_to_keep=1).
  * decode: greedy generation of --new-tokens tokens after 64-token prompts at batch 1, 8
    and 64: glmjax.generate against transformers' generate with its KV cache, and at the
    largest batch also the rollout engine (rl/engine/engine.py through its Driver) on the same
    requests. `steady` figures leave the prefill out: (time for n tokens less the time
    for 1) over n - 1, the same way on both sides.
  * learner: one SAO learner step of the main job (configs/sao_tiny.py: batch 64 x 28
    tokens, the critic's values and 2 updates, then the actor's update) on a random batch.
Floors (benchmarks/floor.py, measured in this run): prefill FLOPs (the LM head at the last
token) at the matmul rate; per
decode step the larger of its FLOPs at that rate and its bytes at the read bandwidth; the
learner step's FLOPs (9 forwards: 2 critic updates and 1 actor update, each a forward and
a backward, the first critic forward also giving the values; and the expert tiles
recomputed in each of the 3 backward passes) at the matmul rate. `*_over_floor` is floor time over measured time.

The arms run in turn, repeat by repeat (floor.interleaved); every arm's median wall time,
CPU time and CPU/wall ratio are in the JSON under "arms". Speedups are glmjax over
transformers. --profile DIR writes a JAX profiler trace of one run of each glmjax arm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import floor  # noqa: E402

import glmjax  # noqa: E402
from glmjax import presets  # noqa: E402
from rl.config import JobConfig  # noqa: E402
from rl.engine.driver import Driver, Request  # noqa: E402
from rl.engine.engine import GlmEngine  # noqa: E402
from rl.learner import Learner, ValueModel  # noqa: E402
from rl.sao import Batch  # noqa: E402


def _prefill_arms(args, config, model, hf, rng) -> tuple[dict, float]:
    ids = rng.integers(0, config.vocab_size, (args.prefill_batch, args.prefill_len))
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, ids):
        m = nnx.merge(graphdef, state)
        last = jnp.full((ids.shape[0], 1), ids.shape[1] - 1)
        return m(ids, cache=glmjax.KVCache.init(m.config, ids.shape[0], ids.shape[1]), logits_at=last).logits[:, 0]

    jids, tids = jnp.asarray(ids, jnp.int32), torch.tensor(ids)

    def hf_prefill():
        with torch.no_grad():
            return hf(tids, use_cache=True, logits_to_keep=1).logits

    return {"prefill": lambda: prefill(state, jids), "hf_prefill": hf_prefill}, ids.size


def _decode_arms(args, config, model, hf, rng, b: int) -> dict:
    prompt = rng.integers(2, config.vocab_size, (b, args.prompt_len))
    jp, tp = jnp.asarray(prompt, jnp.int32), torch.tensor(prompt)

    def hf_generate(n):
        with torch.no_grad():
            return hf.generate(tp, attention_mask=torch.ones_like(tp), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, pad_token_id=0)

    n = args.new_tokens
    arms = {f"decode_b{b}": lambda: glmjax.generate(model, jp, n),
            f"decode_b{b}_first": lambda: glmjax.generate(model, jp, 1), f"hf_decode_b{b}": lambda: hf_generate(n), f"hf_decode_b{b}_first": lambda: hf_generate(1)}
    if b == max(args.batches):
        engine = GlmEngine(model, max_concurrent_decodes=b, max_len=args.prompt_len + n + 1,
                           prefill_buckets=(args.prompt_len,))
        driver = Driver(engine)
        requests = [Request(list(map(int, p)), n) for p in prompt]

        def serve():
            handles = [driver.submit(r) for r in requests]
            driver.run_until_idle()
            return [h.result().tokens for h in handles]

        arms[f"engine_b{b}"] = serve
    return arms


def _learner_arm(rng) -> tuple[dict, glmjax.ModelConfig, tuple[int, int]]:
    cfg = presets.load_config(REPO / "configs" / "sao_tiny.py")
    config = presets.model_config_from(cfg)
    policy = glmjax.init_model(config, seed=0)
    critic = ValueModel(glmjax.init_model(config, seed=1))
    learner = Learner(policy, critic, dataclasses.replace(JobConfig.from_config(cfg).rl, critic_warmup=0))
    rows, length = cfg.rl.batch_size, cfg.task.max_len
    prompt = 18
    tokens = rng.integers(2, config.vocab_size, (rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.float32)
    mask[:, prompt:] = 1.0
    batch = Batch(tokens=jnp.asarray(tokens), action_mask=jnp.asarray(mask),
                  logp_rollout=jnp.asarray(-rng.exponential(1.0, (rows, length)).astype(np.float32) * mask),
                  versions=jnp.zeros((rows, length), jnp.int32),
                  rewards=jnp.asarray(rng.integers(0, 2, rows).astype(np.float32)),
                  values=jnp.zeros((rows, length), jnp.float32), rollout_id=jnp.arange(rows),
                  segment_index=jnp.zeros((rows,), jnp.int32))
    return {"learner_step": lambda: learner.step(batch)}, config, (rows, length)


def learner_flops(config, rows: int, length: int) -> float:
    """The learner step's FLOPs (module docstring): 9 forwards and 3 expert recomputations."""
    f = floor.forward_flops(config, rows, length)
    return 9 * f["total"] + 3 * f["experts"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--config", default=str(REPO / "configs" / "small.py"))
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", default=None, help="write a JAX profiler trace of each glmjax arm under DIR")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    config = presets.model_config_from(presets.load_config(args.config)).replace(num_nextn_predict_layers=0)
    model = glmjax.init_model(config, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        glmjax.save_pretrained(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()

    rng = np.random.default_rng(0)
    results = {"config": os.path.relpath(args.config, REPO), "params": glmjax.count_params(config),
               "device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}", "machine": platform.processor(),
               "cpus": os.cpu_count(), "repeats": args.repeats, "new_tokens": args.new_tokens,
               "ceiling": floor.measure_ceiling()}
    ceiling = results["ceiling"]
    print(f"ceiling: matmul {ceiling['matmul_gflops']:.0f} GFLOP/s, reads {ceiling['read_gb_per_s']:.1f} GB/s",
          flush=True)

    arms, n_prefill = _prefill_arms(args, config, model, hf, rng)
    for b in args.batches:
        arms.update(_decode_arms(args, config, model, hf, rng, b))
    learner_arm, tiny, (rows, length) = _learner_arm(rng)
    arms.update(learner_arm)
    for name, fn in arms.items():  # compile, then one warm run (the one profiled)
        jax.block_until_ready(fn())
        with floor.profile(args.profile if not name.startswith("hf_") else None, name):
            jax.block_until_ready(fn())
    timed = floor.interleaved(arms, args.repeats)
    results["arms"] = timed
    t = {name: a["seconds"] for name, a in timed.items()}

    n = args.new_tokens
    results["prefill_tokens_per_s"] = n_prefill / t["prefill"]
    results["hf_prefill_tokens_per_s"] = n_prefill / t["hf_prefill"]
    results["prefill_floor_tokens_per_s"] = n_prefill / floor.prefill_floor(config, args.prefill_batch,
                                                                            args.prefill_len, ceiling)
    results["prefill_speedup_vs_hf"] = t["hf_prefill"] / t["prefill"]
    results["prefill_over_floor"] = results["prefill_tokens_per_s"] / results["prefill_floor_tokens_per_s"]
    print(f"prefill: glmjax {results['prefill_tokens_per_s']:.0f} tok/s  transformers "
          f"{results['hf_prefill_tokens_per_s']:.0f}  floor {results['prefill_floor_tokens_per_s']:.0f}  "
          f"({results['prefill_over_floor']:.2f} of the floor)", flush=True)
    for b in args.batches:
        k = f"b{b}"
        steady = b * (n - 1) / (t[f"decode_{k}"] - t[f"decode_{k}_first"])
        hf_steady = b * (n - 1) / (t[f"hf_decode_{k}"] - t[f"hf_decode_{k}_first"])
        floor_steady = b * (n - 1) / floor.decode_floor(config, b, args.prompt_len, n, ceiling)
        results[f"decode_{k}_tokens_per_s"] = b * n / t[f"decode_{k}"]
        results[f"hf_decode_{k}_tokens_per_s"] = b * n / t[f"hf_decode_{k}"]
        results[f"decode_{k}_speedup_vs_hf"] = t[f"hf_decode_{k}"] / t[f"decode_{k}"]
        results[f"decode_{k}_steady_tokens_per_s"] = steady
        results[f"hf_decode_{k}_steady_tokens_per_s"] = hf_steady
        results[f"decode_{k}_steady_speedup_vs_hf"] = steady / hf_steady
        results[f"decode_{k}_floor_tokens_per_s"] = floor_steady
        results[f"decode_{k}_over_floor"] = steady / floor_steady
        print(f"decode {k}: glmjax {b * n / t[f'decode_{k}']:.0f} tok/s  transformers "
              f"{b * n / t[f'hf_decode_{k}']:.0f}  steady {steady:.0f} vs {hf_steady:.0f}  floor {floor_steady:.0f} "
              f"({steady / floor_steady:.2f} of the floor)", flush=True)
    top = max(args.batches)
    results[f"engine_b{top}_tokens_per_s"] = top * n / t[f"engine_b{top}"]
    results[f"generate_b{top}_over_engine_b{top}"] = t[f"engine_b{top}"] / t[f"decode_b{top}"]

    flops = learner_flops(tiny, rows, length)
    results["learner_step_shape"] = {"rows": rows, "tokens": length, "config": "configs/sao_tiny.py"}
    results["learner_step_seconds"] = t["learner_step"]
    results["learner_step_gflop"] = flops / 1e9
    results["learner_step_floor_seconds"] = floor.seconds(flops, 0, ceiling)
    results["learner_step_over_floor"] = results["learner_step_floor_seconds"] / t["learner_step"]
    print(f"learner step: {t['learner_step'] * 1e3:.0f} ms for {flops / 1e9:.2f} GFLOP, floor "
          f"{results['learner_step_floor_seconds'] * 1e3:.1f} ms ({results['learner_step_over_floor']:.3f} of it); "
          f"generate b{top} / engine b{top}: {results[f'generate_b{top}_over_engine_b{top}']:.2f}", flush=True)
    starved = {name: a["cpu_over_wall"] for name, a in timed.items() if a["reruns"]}
    if starved:
        print(f"arms run again after a starved run: {starved}")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
