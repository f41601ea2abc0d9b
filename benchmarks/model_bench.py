"""Prefill and decode throughput of glmjax against transformers, same weights, one run.

    python benchmarks/model_bench.py --out results/model_bench.json

The model is configs/small.py with random weights, written by glmjax.save_pretrained and
read by transformers' AutoModelForCausalLM, so both run identical parameters in fp32.
Prefill: batch 4 x 512 tokens. Decode: greedy generation of --new-tokens tokens after
64-token prompts at batch 1, 8 and 64 (glmjax.generate vs transformers' generate with
its KV cache). Figures are medians of --repeats timed runs after a warm-up run (which
also compiles). Speedups are glmjax over transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import glmjax  # noqa: E402
from glmjax import presets  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up / compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

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
               "cpus": os.cpu_count(), "repeats": args.repeats, "new_tokens": args.new_tokens}

    # Prefill: the prompt's forward pass, writing the KV cache.
    ids = rng.integers(0, config.vocab_size, (args.prefill_batch, args.prefill_len))
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, ids):
        m = nnx.merge(graphdef, state)
        return m(ids, cache=glmjax.KVCache.init(m.config, ids.shape[0], ids.shape[1])).logits[:, -1]

    jids, tids = jnp.asarray(ids, jnp.int32), torch.tensor(ids)
    n_prefill = ids.size
    t_ours = median_seconds(lambda: prefill(state, jids).block_until_ready(), args.repeats)
    with torch.no_grad():
        t_hf = median_seconds(lambda: hf(tids, use_cache=True, logits_to_keep=1), args.repeats)
    results["prefill_tokens_per_s"] = n_prefill / t_ours
    results["hf_prefill_tokens_per_s"] = n_prefill / t_hf

    # Decode: greedy generation after a short prompt.
    results["decode_tokens_per_s"], results["hf_decode_tokens_per_s"] = {}, {}
    for b in batches:
        prompt = rng.integers(2, config.vocab_size, (b, args.prompt_len))
        jp, tp = jnp.asarray(prompt, jnp.int32), torch.tensor(prompt)
        n = b * args.new_tokens
        t_ours = median_seconds(lambda: glmjax.generate(model, jp, args.new_tokens).block_until_ready(), args.repeats)
        with torch.no_grad():
            t_hf = median_seconds(lambda: hf.generate(tp, attention_mask=torch.ones_like(tp), do_sample=False,
                                                      max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                                      pad_token_id=0), args.repeats)
        results["decode_tokens_per_s"][f"b{b}"] = n / t_ours
        results["hf_decode_tokens_per_s"][f"b{b}"] = n / t_hf
        print(f"decode b{b}: glmjax {n / t_ours:8.1f} tok/s   transformers {n / t_hf:8.1f} tok/s", flush=True)

    results["prefill_speedup_vs_hf"] = results["prefill_tokens_per_s"] / results["hf_prefill_tokens_per_s"]
    for b in batches:
        key = f"b{b}"
        results[f"decode_{key}_speedup_vs_hf"] = (results["decode_tokens_per_s"][key]
                                                   / results["hf_decode_tokens_per_s"][key])
    print(f"prefill: glmjax {results['prefill_tokens_per_s']:.1f} tok/s   transformers "
          f"{results['hf_prefill_tokens_per_s']:.1f} tok/s   speedup {results['prefill_speedup_vs_hf']:.2f}x")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
