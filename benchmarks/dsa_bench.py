"""Dense MLA vs DSA vs IndexShare: prefill and decode cost from 1k to 32k tokens of context.

    python benchmarks/dsa_bench.py --out results/dsa_bench.json    # + results/dsa_bench.png

One long-context small model in three variants that differ only in attention selection:
  * dense:      index_topk = max_position_embeddings, so the model's dense path runs;
  * dsa:        index_topk = 256 with an indexer in every layer (DeepSeek-V3.2's DSA);
  * indexshare: the same, but only layer 0 of each 4 runs an indexer ("FSSS"), the others
                reuse its selection (IndexShare / IndexCache).
The attention is GLM-5's with heads and widths / 4: 16 heads over a 128 + 16 latent key,
8 indexer heads of 32, top-256 (GLM-5: 64 heads, 512 + 64, 32 x 128, top-2048). So, as in
GLM-5, per (query, key) pair the main attention costs 17x the indexer (16 * (2 * 128 + 16)
vs 8 * 32 multiply-adds) and a latent row is 4.5x the bytes of an indexer key. Hidden
512, 4 layers with dense SwiGLU MLPs. It runs the XLA path (kernel_impl="xla":
interpret-mode Pallas is far too slow to time), fp32.

Prefill: seconds per token of `model(ids)` over the whole context, with the logits of its
last token (`logits_at`). Decode: seconds per step of one new token for each of 8
sequences whose caches hold the context (a serving batch; at batch 1 a CPU step reads
more weight bytes than cache bytes). Times are medians
of up to 3 rounds in which the three variants run back to back, so that other load on
the machine hits them alike; long contexts get fewer rounds to fit ~20 minutes on two CPU
cores. Wall-clock seconds are the figures; process CPU seconds and each arm's CPU / wall
ratio (cores kept busy) are recorded beside them, with the same ratios computed from CPU
time under "cpu_time", and in FLOPs under "flops" (what a ratio would be if every arm ran
at one rate). A run starved of the cores (benchmarks/floor.py) is run again, counted
under "reruns". --profile DIR writes a JAX profiler trace of each arm.

The JSON also states the live memory of the sparse path at 32k: XLA's own accounting
(`compiled.memory_analysis()`) of the DSA attention pieces compiled for one layer.
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
from pallas_kernels import reference

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import floor  # noqa: E402

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
TOPK = 256
DECODE_BATCH = 8
DECODE_STEPS = 4
ROUND_BUDGET_S = 40.0  # another round of repetitions while a round takes less than this (<= 3 rounds)


def base_config(**changes) -> glmjax.ModelConfig:
    c = dict(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=48,
        qk_rope_head_dim=16, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=4,
        index_n_heads=8, index_head_dim=32, index_topk=TOPK, num_nextn_predict_layers=0,
        max_position_embeddings=65536, pad_token_id=None,
    )
    c.update(changes)
    return glmjax.ModelConfig(**c)


VARIANTS = {
    "dense": base_config(index_topk=65536),
    "dsa": base_config(),
    "indexshare": base_config(index_topk_pattern="FSSS"),
}


def _rounds(runners: dict) -> dict:
    """Times each runner once per round, the variants back to back, for up to 3 rounds
    while a round stays under ROUND_BUDGET_S; a run starved of the cores is run again
    (floor.rerun_starved). Returns {name: floor.summary(...)}."""
    times = {name: [] for name in runners}
    while True:
        start = time.perf_counter()
        for name, run in runners.items():
            times[name].append(run())
        rounds = len(next(iter(times.values())))
        if rounds == 3 or time.perf_counter() - start > ROUND_BUDGET_S:
            break
    return {name: floor.summary(*floor.rerun_starved(ts, runners[name])) for name, ts in times.items()}


def prefill_runner(config, context: int):
    """A compiled `model(ids)` over `context` tokens; calling it times one run."""
    graphdef, state = nnx.split(glmjax.init_model(config, seed=0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, context)), jnp.int32)

    @jax.jit
    def prefill(state, ids):
        return nnx.merge(graphdef, state)(ids, logits_at=jnp.full((1, 1), context - 1)).logits[:, 0]

    compiled = prefill.lower(state, ids).compile()
    return lambda: floor.clock(lambda: compiled(state, ids))


def filled_cache(config, batch: int, context: int, max_len: int) -> glmjax.KVCache:
    """A cache whose first `context` positions hold random latents and indexer keys."""
    cache = glmjax.KVCache.init(config, batch, max_len)
    keys = iter(jax.random.split(jax.random.key(1), 3 * len(cache.layers)))
    fill = lambda x: None if x is None else jax.random.normal(next(keys), x.shape, x.dtype)  # noqa: E731
    layers = tuple(glmjax.LayerCache(*(fill(x) for x in layer)) for layer in cache.layers)
    return cache._replace(layers=layers, lengths=jnp.full((batch,), context, jnp.int32))


def decode_runner(config, context: int):
    """A compiled decode step of DECODE_BATCH sequences (cache donated); calling it times
    DECODE_STEPS steps and returns the median step."""
    graphdef, state = nnx.split(glmjax.init_model(config, seed=0))
    holder = {"cache": filled_cache(config, DECODE_BATCH, context, context + 4 * DECODE_STEPS),
              "token": jnp.zeros((DECODE_BATCH, 1), jnp.int32)}

    @jax.jit(donate_argnums=1)
    def step(state, cache, token):
        out = nnx.merge(graphdef, state)(token, cache=cache)
        return out.cache, jnp.argmax(out.logits[:, -1], -1)[:, None].astype(jnp.int32)

    compiled = step.lower(state, holder["cache"], holder["token"]).compile()

    def one():
        holder["cache"], holder["token"] = compiled(state, holder["cache"], holder["token"])
        return holder["token"]

    def run():
        steps = [floor.clock(one) for _ in range(DECODE_STEPS)]
        return statistics.median(w for w, _ in steps), statistics.median(c for _, c in steps)

    return run


def measure(context: int, profile: str | None = None) -> dict:
    """{variant: {"prefill": ..., "decode": ...}} at one context; with `profile`, a JAX
    profiler trace of one prefill and one decode round of each variant under that folder."""
    out = {v: {} for v in VARIANTS}
    runners = {v: prefill_runner(cfg, context) for v, cfg in VARIANTS.items()}
    for v, run in runners.items():
        with floor.profile(profile, f"prefill_{v}_{context}"):
            run()
    for v, t in _rounds(runners).items():
        out[v]["prefill"] = {"s_per_token": t["seconds"] / context, "cpu_s_per_token": t["cpu_seconds"] / context,
                             "seconds": t["seconds"], "cpu_over_wall": t["cpu_over_wall"], "reps": t["runs"],
                             "reruns": t["reruns"]}
    runners = {v: decode_runner(cfg, context) for v, cfg in VARIANTS.items()}
    for v, run in runners.items():
        with floor.profile(profile, f"decode_{v}_{context}"):
            run()  # the first steps settle allocations
    for v, t in _rounds(runners).items():
        out[v]["decode"] = {"s_per_step": t["seconds"], "cpu_s_per_step": t["cpu_seconds"],
                            "cpu_over_wall": t["cpu_over_wall"], "batch": DECODE_BATCH,
                            "reps": f"{t['runs']} x median of {DECODE_STEPS} steps", "reruns": t["reruns"]}
    return out


def sparse_path_memory(config, context: int) -> dict:
    """XLA's peak temporary bytes for one layer's DSA attention at `context` tokens: the
    indexer's top-k and the gathered sparse attention, compiled on their own."""
    c = config
    f32 = jnp.float32
    shape = lambda *s: jax.ShapeDtypeStruct(s, f32)  # noqa: E731
    pos = jax.ShapeDtypeStruct((1, context), jnp.int32)
    topk = jax.ShapeDtypeStruct((1, context, c.index_topk), jnp.int32)
    h, cd, r, g, i = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.index_n_heads, c.index_head_dim
    attend = jax.jit(lambda qc, qr, ckv, kr, p, idx: reference.sparse_mla_attention(
        qc, qr, ckv, kr, p, idx, scale=c.softmax_scale))
    select = jax.jit(lambda q, w, k, p: reference.indexer_topk(q, w, k, p, topk=c.index_topk))
    out = {}
    for name, fn, args in (
        ("sparse_mla_attention", attend,
         (shape(1, context, h, cd), shape(1, context, h, r), shape(1, context, cd), shape(1, context, r), pos, topk)),
        ("indexer_topk", select, (shape(1, context, g, i), shape(1, context, g), shape(1, context, i), pos)),
    ):
        stats = fn.lower(*args).compile().memory_analysis()
        out[name] = {"temp_bytes": int(stats.temp_size_in_bytes),
                     "argument_bytes": int(stats.argument_size_in_bytes),
                     "output_bytes": int(stats.output_size_in_bytes)}
    out["dense_masked_scores_bytes_would_be"] = int(context * context * h * 4)
    return out


def key_field(kind: str) -> str:
    return "s_per_token" if kind == "prefill" else "s_per_step"


GOALS = {"dsa_vs_dense_prefill_32k": (">=", 4.0), "indexshare_vs_dsa_prefill_32k": (">=", 1.5),
         "dsa_per_token_32k_over_4k": ("<=", 1.5), "dsa_vs_dense_decode_32k": (">=", 3.0)}


def summarise(results, clock: str = "") -> dict:
    """The four headline ratios at 32k (and 4k) from wall-clock ("") or CPU ("cpu_") medians."""
    top, low = str(CONTEXTS[-1]), "4096"
    pre = lambda v, ctx: results[v]["prefill"][ctx][clock + "s_per_token"]  # noqa: E731
    dec = lambda v, ctx: results[v]["decode"][ctx][clock + "s_per_step"]  # noqa: E731
    return {
        "dsa_vs_dense_prefill_32k": pre("dense", top) / pre("dsa", top),
        "indexshare_vs_dsa_prefill_32k": pre("dsa", top) / pre("indexshare", top),
        "dsa_per_token_32k_over_4k": pre("dsa", top) / pre("dsa", low),
        "dsa_vs_dense_decode_32k": dec("dense", top) / dec("dsa", top),
    }


def flop_ratios() -> dict:
    """The same ratios in FLOPs (benchmarks/floor.py's count of a causal prefill): what
    each would be if every arm ran at one rate. The indexer scores every visible key, so
    DSA's FLOPs per token grow with the context too."""
    top, low = CONTEXTS[-1], 4096
    per_token = lambda v, ctx: floor.forward_flops(VARIANTS[v], 1, ctx, logits=1)["total"] / ctx  # noqa: E731
    return {"dsa_vs_dense_prefill_32k": per_token("dense", top) / per_token("dsa", top),
            "indexshare_vs_dsa_prefill_32k": per_token("dsa", top) / per_token("indexshare", top),
            "dsa_per_token_32k_over_4k": per_token("dsa", top) / per_token("dsa", low),
            "mflop_per_token": {v: {str(c): per_token(v, c) / 1e6 for c in (low, top)} for v in VARIANTS}}


def goals(summary: dict) -> dict:
    return {k: {"goal": f"{op} {v}", "value": summary[k], "met": summary[k] >= v if op == ">=" else summary[k] <= v}
            for k, (op, v) in GOALS.items()}


def plot(results, path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind, unit in ((axes[0], "prefill", "s / token"), (axes[1], "decode", "s / step")):
        for variant, res in results.items():
            xs = sorted(int(c) for c in res[kind])
            ax.plot(xs, [res[kind][str(x)][key_field(kind)] for x in xs], marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(f"{kind} (XLA path, CPU)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON path; the plot goes beside it as .png")
    parser.add_argument("--contexts", type=int, nargs="*", default=list(CONTEXTS),
                        help="a subset for a quick look (the summary needs 4096 and 32768)")
    parser.add_argument("--profile", default=None,
                        help="write a JAX profiler trace of each variant's prefill and decode under DIR")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = {v: {"prefill": {}, "decode": {}} for v in VARIANTS}
    print(f"{'context':>8} {'variant':>11} {'prefill s/tok':>14} {'cpu/wall':>9} {'decode s/step':>14} "
          f"{'cpu/wall':>9}")
    for context in args.contexts:
        for variant, res in measure(context, args.profile).items():
            pre, dec = res["prefill"], res["decode"]
            results[variant]["prefill"][str(context)] = pre
            results[variant]["decode"][str(context)] = dec
            print(f"{context:>8} {variant:>11} {pre['s_per_token']:>14.3e} {pre['cpu_over_wall']:>9.2f} "
                  f"{dec['s_per_step']:>14.3e} {dec['cpu_over_wall']:>9.2f}", flush=True)
    report = {
        "config": {k: v for k, v in VARIANTS["dsa"].to_hf().items() if not isinstance(v, list)},
        "variants": {"dense": "index_topk = max_position_embeddings (dense path)",
                     "dsa": f"index_topk = {TOPK}, indexer in every layer",
                     "indexshare": f"index_topk = {TOPK}, pattern FSSS (1 indexer in 4 layers)"},
        "device": jax.devices()[0].device_kind, "kernel_impl": "xla", "dtype": "float32",
        "results": results,
        "sparse_path_memory_32k": sparse_path_memory(VARIANTS["dsa"], 32768),
        "wall_seconds": time.perf_counter() - start,
    }
    if {4096, CONTEXTS[-1]} <= set(args.contexts):
        report.update(summarise(results))
        report["goals"] = goals(report)
        report["cpu_time"] = summarise(results, "cpu_")  # the same ratios from process CPU seconds
        report["cpu_time"]["goals"] = goals(report["cpu_time"])
        report["flops"] = flop_ratios()
        for k, g in report["goals"].items():
            cpu = report["cpu_time"][k]
            print(f"{k:>32}: {g['value']:.2f} (goal {g['goal']}: {'met' if g['met'] else 'missed'}; "
                  f"cpu-time {cpu:.2f}; in FLOPs {report['flops'].get(k, float('nan')):.2f})")
    mem = report["sparse_path_memory_32k"]
    print("sparse path temp bytes at 32k:", {k: v["temp_bytes"] for k, v in mem.items() if isinstance(v, dict)})
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(out, report)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {report['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
