"""This machine's floor for a workload, measured in the same run as the workload itself,
and the clock the benchmarks time their arms with.

    ceiling = measure_ceiling()                          # matmul FLOP/s, read bytes/s
    floor_s = seconds(flops, bytes, ceiling)             # max(FLOPs / rate, bytes / bandwidth)
    timed = interleaved({"glmjax": f, "transformers": g}, repeats=3)

The ceiling: the fp32 rate of one large matmul (jit, 2048^3) and the read bandwidth of a
sum over 400 MB, each the best of 10 runs. A workload's floor is its FLOPs at that rate or
its bytes at that bandwidth, whichever is longer; `*_over_floor` figures are floor time
over measured time (1.0 = at the floor).

FLOPs are counted from the config (`forward_flops`): 2 per multiply-add of every matmul
weight a token passes through (the routed experts at X/E of their size, embeddings not: a
lookup; the LM head only where logits are wanted, one position per row in a prefill),
plus attention over the keys each query sees (absorbed MLA: its scores over the C + R
wide key and its values over the C wide latent; top-k keys on DSA layers) and the
indexer's scoring on layers that own one. Bytes are the weights a step reads (dense ones,
and the routed experts a batch touches under uniform routing) plus the cache rows it reads.

`interleaved` runs the arms in turn, repeat by repeat, so that other load on the machine
hits them alike, and records each run's wall and process CPU time. A run whose wall time
is over 1.3x the arm's fastest while its CPU/wall ratio is under 0.75x the arm's best was
starved of the cores; it is run again (up to `reruns` times per arm), and the arm's CPU /
wall ratio is reported beside its median so that a starved figure shows.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import glmjax


def _best(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def measure_ceiling() -> dict:
    """{"matmul_gflops", "read_gb_per_s"} of this machine now."""
    a = jax.random.normal(jax.random.key(0), (2048, 2048))
    flops = 2 * 2048 ** 3 / _best(jax.jit(lambda a: a @ a), a)
    big = jnp.ones((100_000_000,), jnp.float32)
    bandwidth = big.nbytes / _best(jax.jit(jnp.sum), big)
    del big
    return {"matmul_gflops": flops / 1e9, "read_gb_per_s": bandwidth / 1e9}


def seconds(flops: float, nbytes: float, ceiling: dict) -> float:
    return max(flops / (ceiling["matmul_gflops"] * 1e9), nbytes / (ceiling["read_gb_per_s"] * 1e9))


# What a forward computes and reads --------------------------------------------------------
def _is_expert(names) -> bool:
    return "experts" in names


@functools.lru_cache(maxsize=8)
def weight_sizes(config: glmjax.ModelConfig) -> dict:
    """Matmul weights by kind, in elements: {"dense", "experts", "embed", "mtp"} (norm
    scales and biases left out), and "head", the LM head's part of "dense"; traced once per
    config (decode_floor asks per step)."""
    abstract = nnx.state(nnx.eval_shape(lambda: glmjax.init_model(config)), nnx.Param)
    sizes = {"dense": 0, "experts": 0, "embed": 0, "mtp": 0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        names = [str(getattr(k, "key", k)) for k in path]
        if len(leaf.shape) < 2:
            continue
        kind = ("embed" if "embed_tokens" in names else "mtp" if names[0] == "mtp"
                else "experts" if _is_expert(names) else "dense")
        sizes[kind] += int(leaf.size)
    if config.tie_word_embeddings:
        sizes["dense"] += config.vocab_size * config.hidden_size  # the head reads the embedding
    sizes["head"] = config.vocab_size * config.hidden_size  # the LM head's part of "dense"
    return sizes


def forward_flops(config: glmjax.ModelConfig, rows: int, queries: int, cached: int = 0,
                  logits: int | None = None) -> dict:
    """FLOPs of a forward of `queries` new tokens in each of `rows` sequences after `cached`
    cached ones (causal: the query at position p sees p + 1 keys), with the LM head at
    `logits` positions per row (default every query; a prefill needs one). Returns
    {"matmul", "attention", "experts", "total"}; "experts" (a part of "matmul") is what
    rematerialising the expert tiles repeats in a backward pass."""
    c = config
    sizes = weight_sizes(c)
    tokens = rows * queries
    experts = 2 * tokens * sizes["experts"] * c.num_experts_per_tok / c.n_routed_experts
    head = 2 * rows * (queries if logits is None else logits) * sizes["head"]
    matmul = 2 * tokens * (sizes["dense"] - sizes["head"]) + head + experts
    per_key = 2 * c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim)  # scores + values
    per_index_key = 2 * c.index_n_heads * c.index_head_dim
    attention = 0
    for layer in range(c.num_hidden_layers):
        for p in range(cached, cached + queries):
            visible = p + 1
            sparse = c.index_topk < cached + queries
            attention += per_key * (min(visible, c.index_topk) if sparse else visible)
            if sparse and c.has_indexer(layer):
                attention += per_index_key * visible
    attention *= rows
    return {"matmul": matmul, "attention": attention, "experts": experts, "total": matmul + attention}


def decode_step_bytes(config: glmjax.ModelConfig, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences over `context` cached tokens reads: the
    dense weights, the experts the batch touches (uniform routing), the cache rows."""
    c = config
    sizes = weight_sizes(c)
    itemsize = jnp.dtype(c.param_dtype).itemsize
    touched = 1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch
    weights = (sizes["dense"] + sizes["experts"] * touched) * itemsize
    latent = (c.kv_lora_rank + c.qk_rope_head_dim) * jnp.dtype(c.dtype).itemsize
    sparse = c.index_topk < context
    cache = 0
    for layer in range(c.num_hidden_layers):
        cache += latent * (min(context, c.index_topk) if sparse else context)
        if sparse and c.has_indexer(layer):
            cache += c.index_head_dim * jnp.dtype(c.dtype).itemsize * context
    return int(weights + batch * cache)


def prefill_floor(config, rows: int, length: int, ceiling: dict) -> float:
    """Seconds: a prefill's FLOPs (the next token's logits only) at the matmul rate (its
    weight reads are far below)."""
    return seconds(forward_flops(config, rows, length, logits=1)["total"], 0, ceiling)


def decode_floor(config, batch: int, prompt: int, new: int, ceiling: dict) -> float:
    """Seconds for `new` - 1 steady decode steps after a `prompt`-token prefill (the first
    new token comes with the prefill): per step the larger of its FLOPs and its bytes."""
    total = 0.0
    for i in range(1, new):
        context = prompt + i
        total += seconds(forward_flops(config, batch, 1, context - 1)["total"],
                         decode_step_bytes(config, batch, context), ceiling)
    return total


# Timing -------------------------------------------------------------------------------------
def clock(fn: Callable) -> tuple[float, float]:
    """(wall, process CPU) seconds of fn() with its results ready."""
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - wall, time.process_time() - cpu


def starved(runs: list[tuple[float, float]]) -> list[bool]:
    """Which of an arm's (wall, CPU) runs were starved of the cores (module docstring)."""
    fastest = min(w for w, _ in runs)
    best_ratio = max(c / w for w, c in runs)
    return [w > 1.3 * fastest and c / w < 0.75 * best_ratio for w, c in runs]


def rerun_starved(runs: list[tuple[float, float]], run: Callable[[], tuple[float, float]],
                  reruns: int = 2) -> tuple[list[tuple[float, float]], int]:
    """Replaces starved runs by new ones from `run` (it returns (wall, CPU)), at most
    `reruns` times. Returns (the runs kept, how many were run again)."""
    extra = 0
    while extra < reruns:
        flags = starved(runs)
        if not any(flags):
            break
        runs = [r for r, bad in zip(runs, flags) if not bad] + [run()]
        extra += 1
    return runs, extra


def summary(runs: list[tuple[float, float]], extra: int) -> dict:
    return {"seconds": statistics.median(w for w, _ in runs), "cpu_seconds": statistics.median(c for _, c in runs),
            "cpu_over_wall": statistics.median(c / w for w, c in runs), "runs": len(runs), "reruns": extra}


def interleaved(arms: dict[str, Callable], repeats: int, *, reruns: int = 2) -> dict:
    """Each arm once per repeat, in turn (module docstring). Returns per arm
    {"seconds": median wall, "cpu_seconds": median CPU, "cpu_over_wall", "runs", "reruns"}.
    Each arm should have run once before (compile, warm-up)."""
    runs = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            runs[name].append(clock(fn))
    return {name: summary(*rerun_starved(runs[name], lambda fn=fn: clock(fn), reruns)) for name, fn in arms.items()}


@contextlib.contextmanager
def profile(directory: str | None, name: str):
    """A JAX profiler trace of the block under `directory`/`name` (TensorBoard's profile
    plugin or Perfetto opens it); nothing when directory is None."""
    if directory is None:
        yield
        return
    with jax.profiler.trace(f"{directory}/{name}", create_perfetto_trace=True):
        yield


def main_with_profile(main: Callable, name: str) -> None:
    """Runs a benchmark's main() with `--profile DIR` taken off the command line, under a
    JAX profiler trace of the whole run in DIR/name (for the scripts that do not trace
    their arms one by one)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--profile", default=None)
    known, rest = parser.parse_known_args(sys.argv[1:])
    sys.argv[1:] = rest
    if {"-h", "--help"} & set(rest):  # main's own help, then the option taken off here
        try:
            main()
        finally:
            print(f"  --profile DIR         a JAX profiler trace of the whole run, written to DIR/{name}")
    with profile(known.profile, name):
        main()
