"""What XLA:CPU's own kernels reach on this machine for the pieces the model's hot paths are
made of, each beside the ceiling that benchmarks/floor.py measures in the same run.

    python benchmarks/cpu_primitives.py --out results/cpu_primitives.json

The floors of model_bench, engine_bench and dsa_bench assume every matmul runs at the rate
of one large matmul and every weight byte is read at the bandwidth of a streaming sum. The
model is made of smaller pieces:
  * expert products: t rows through one expert's [512, 256] matrix (configs/small.py's
    experts), for each of 32 stacked experts, the weights cold (8 layers' worth, over the
    L3). "in place": one product batched over the stacked experts; "sliced": a loop that
    takes each expert's matrix as `w[e]`, which is how the tile loop of layers/gmm.py
    reads them (XLA:CPU copies a dynamic slice before the dot). t = 1 is decode at small
    batch (a matrix-vector product per row), t = 8 decode at batch 64, t = 128 prefill.
  * top-k (the indexer's selection, k = 256 of a row): XLA:CPU's is a partial sort on one
    core; its cost per key scanned and per row is fitted from rows of two lengths.
  * loop bodies: a `lax.map` step with two independent top-ks against one. 2.0 means the
    two ran one after the other: the ops of a loop body do not run side by side.
  * fresh outputs: writing 256 MB into a buffer of its own (every run of a program gets new
    output buffers, and glibc maps large ones afresh, one page fault per 4 KB page) against
    reading the same bytes.
For a weight-bound step, `fraction` of the in-place rows bounds what its `*_over_floor`
figure can reach on XLA:CPU. The arms are interleaved repeat by repeat (floor.interleaved);
figures are medians, each with its CPU/wall ratio.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import resource
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import floor  # noqa: E402

EXPERTS, D, F = 32, 512, 256  # configs/small.py's routed experts
LAYERS = 8  # weight sets cycled through, 8 x 16.8 MB: more than the L3
ROWS_PER_EXPERT = (1, 8, 128)
TOPK, TOPK_ROWS, TOPK_KEYS = 256, 256, (4096, 32768)
FRESH_BYTES = 256 << 20


def _sliced(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [E, t, D] -> [E, t, F], a loop taking each expert's matrix as w[e] (layers/gmm.py's form)."""
    return jax.lax.map(lambda a: a[0] @ w[a[1]], (x, jnp.arange(x.shape[0])))


def expert_arms(weights: list[jax.Array], x: jax.Array) -> dict:
    """{"in_place": fn, "sliced": fn}: x [E, t, D] through every expert's [D, F] matrix of
    every weight set [E, D, F], the two ways of reading the matrices (module docstring)."""
    in_place = jax.jit(lambda x, ws: [jnp.einsum("etD,eDF->etF", x, w) for w in ws])
    sliced = jax.jit(lambda x, ws: [_sliced(x, w) for w in ws])
    return {"in_place": lambda: in_place(x, weights), "sliced": lambda: sliced(x, weights)}


def topk_cost(times: dict[int, float], rows: int) -> dict:
    """Per-row seconds t(S) = a + b * S at two row lengths S -> {"ns_per_key": b, "us_per_row": a}."""
    (s1, t1), (s2, t2) = sorted(times.items())
    per_key = (t2 - t1) / rows / (s2 - s1)
    return {"ns_per_key": 1e9 * per_key, "us_per_row": 1e6 * (t1 / rows - per_key * s1)}


def topk_arms() -> dict:
    arms = {}
    for keys in TOPK_KEYS:
        scores = jax.random.normal(jax.random.key(keys), (TOPK_ROWS, keys))
        arms[f"top_k_{keys}"] = lambda f=jax.jit(lambda s: jax.lax.top_k(s, TOPK)[1]), s=scores: f(s)
    steps = 8
    scores = jax.random.normal(jax.random.key(2), (steps, 2, TOPK_ROWS, TOPK_KEYS[0]))
    one = jax.jit(lambda s: jax.lax.map(lambda x: jax.lax.top_k(x[0], TOPK)[1], s))
    two = jax.jit(lambda s: jax.lax.map(lambda x: (jax.lax.top_k(x[0], TOPK)[1], jax.lax.top_k(x[1], TOPK)[1]), s))
    arms["loop_one_top_k"] = lambda: one(scores)
    arms["loop_two_top_k"] = lambda: two(scores)
    return arms


def fresh_output_arms() -> dict:
    x = jnp.ones((FRESH_BYTES // 4,), jnp.float32)
    write = jax.jit(lambda x: x * 2.0)  # a new 256 MB output per run
    read = jax.jit(lambda x: jnp.sum(x * 2.0))  # the same pass, nothing written
    return {"fresh_output_write": lambda: write(x), "fresh_output_read": lambda: read(x)}


def minor_faults(fn) -> int:
    """Page faults served without I/O while fn runs (the result released at once)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(fn())
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of each arm")
    args = parser.parse_args(argv)

    ceiling = floor.measure_ceiling()
    print(f"ceiling: matmul {ceiling['matmul_gflops']:.0f} GFLOP/s, reads {ceiling['read_gb_per_s']:.1f} GB/s",
          flush=True)
    keys = jax.random.split(jax.random.key(0), LAYERS)
    weights = [jax.random.normal(k, (EXPERTS, D, F)) for k in keys]
    arms = {}
    for rows in ROWS_PER_EXPERT:
        x = jax.random.normal(jax.random.key(rows), (EXPERTS, rows, D))
        arms.update({f"experts_{rows}_{how}": fn for how, fn in expert_arms(weights, x).items()})
    arms.update(topk_arms())
    arms.update(fresh_output_arms())
    for fn in arms.values():  # compile and warm up
        jax.block_until_ready(fn())
    timed = floor.interleaved(arms, args.repeats)
    t = {name: a["seconds"] for name, a in timed.items()}

    weight_bytes = LAYERS * EXPERTS * D * F * 4
    experts = {}
    for rows in ROWS_PER_EXPERT:
        for how in ("in_place", "sliced"):
            s = t[f"experts_{rows}_{how}"]
            gb, gflop = weight_bytes / s / 1e9, 2 * rows * weight_bytes / 4 / s / 1e9
            experts[f"{rows}_rows_{how}"] = {
                "gb_per_s": gb, "gflops": gflop, "cpu_over_wall": timed[f"experts_{rows}_{how}"]["cpu_over_wall"],
                "fraction": max(gb / ceiling["read_gb_per_s"], gflop / ceiling["matmul_gflops"])}
            print(f"experts, {rows} rows, {how}: {gb:.1f} GB/s, {gflop:.1f} GFLOP/s "
                  f"({experts[f'{rows}_rows_{how}']['fraction']:.2f} of the ceiling)", flush=True)
    top_k = topk_cost({k: t[f"top_k_{k}"] for k in TOPK_KEYS}, TOPK_ROWS)
    top_k["cpu_over_wall"] = timed[f"top_k_{TOPK_KEYS[-1]}"]["cpu_over_wall"]
    top_k["k"] = TOPK
    loop = {"two_over_one": t["loop_two_top_k"] / t["loop_one_top_k"],
            "cpu_over_wall": timed["loop_two_top_k"]["cpu_over_wall"]}
    fresh = {"write_ms_per_gb": 1e3 * t["fresh_output_write"] / (FRESH_BYTES / 1e9),
             "read_ms_per_gb": 1e3 * t["fresh_output_read"] / (FRESH_BYTES / 1e9),
             "minor_faults_per_run": minor_faults(arms["fresh_output_write"]),
             "pages": FRESH_BYTES // 4096}
    print(f"top-k of {TOPK}: {top_k['ns_per_key']:.2f} ns per key + {top_k['us_per_row']:.1f} us per row; "
          f"two in one loop step take {loop['two_over_one']:.2f}x one; a fresh 256 MB output "
          f"{fresh['write_ms_per_gb']:.0f} ms/GB against {fresh['read_ms_per_gb']:.0f} to read it "
          f"({fresh['minor_faults_per_run']} page faults)", flush=True)

    results = {"device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}", "machine": platform.processor(),
               "jax": jax.__version__, "repeats": args.repeats, "ceiling": ceiling,
               "expert_shape": {"experts": EXPERTS, "in": D, "out": F, "weight_sets": LAYERS},
               "experts": experts, "top_k": top_k, "loop_body": loop, "fresh_output": fresh, "arms": timed}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    floor.main_with_profile(main, "cpu_primitives")
