"""Regenerates the README's benchmark tables from the JSON files under results/.

    python benchmarks/report.py            # rewrites the block between the markers in README.md

Each benchmark writes its JSON with `--out results/NAME.json`; this script only picks the
headline figures out of it (3 to 5 rows per benchmark, with the peer's figure and the
floor where the benchmark measures them) and links the file, so every figure in the README
comes from a measured run and the rest is one click away.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"
DASH = "–"


def _load(name):
    path = REPO / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _num(v, unit: str = "", digits: int | None = None) -> str:
    """12,800 not 1.28e+04; small values with 2 significant digits."""
    if v is None:
        return DASH
    if digits is None:
        digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2 if abs(v) >= 0.1 else 3
    text = f"{v:,.{digits}f}"
    return f"{text} {unit}".strip()


def _pct(v) -> str:
    return DASH if v is None else f"{100 * v:.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return (["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _source(name: str, what: str) -> str:
    return f"**{what}** (`benchmarks/{name}.py`, [results/{name}.json](results/{name}.json)):"


# One function per results file -------------------------------------------------------------
def model_bench(r) -> list[str]:
    if "prefill_over_floor" not in r:
        return []
    c = r["ceiling"]
    rows = [["prefill, 4 x 512 tokens", _num(r["prefill_tokens_per_s"], "tok/s"),
             _num(r["hf_prefill_tokens_per_s"], "tok/s"), _num(r["prefill_floor_tokens_per_s"], "tok/s"),
             _num(r["prefill_over_floor"])]]
    for b in (1, 8, 64):
        k = f"decode_b{b}"
        if f"{k}_over_floor" in r:
            rows.append([f"greedy decode, batch {b} (steady)", _num(r[f"{k}_steady_tokens_per_s"], "tok/s"),
                         _num(r[f"hf_{k}_steady_tokens_per_s"], "tok/s"), _num(r[f"{k}_floor_tokens_per_s"], "tok/s"),
                         _num(r[f"{k}_over_floor"])])
    shape = r["learner_step_shape"]
    rows.append([f"SAO learner step, sorting job ({shape['rows']} x {shape['tokens']} tokens)",
                 _num(1e3 * r["learner_step_seconds"], "ms"), DASH, _num(1e3 * r["learner_step_floor_seconds"], "ms"),
                 _num(r["learner_step_over_floor"])])
    top = max(int(k[len("decode_b"):-len("_over_floor")]) for k in r if k.startswith("decode_b")
              and k.endswith("_over_floor"))
    return [_source("model_bench", "Model"),
            f"configs/small.py ({r['params'] / 1e6:.0f}M parameters, fp32) on {r['cpus']} CPU cores; floor = FLOPs at "
            f"this run's matmul rate ({c['matmul_gflops']:.0f} GFLOP/s) or bytes at its read bandwidth "
            f"({c['read_gb_per_s']:.0f} GB/s), whichever is longer; medians of {r['repeats']} interleaved runs. "
            f"`glmjax.generate` at batch {top} runs at {r[f'generate_b{top}_over_engine_b{top}']:.2f}x the rollout "
            f"engine's speed on the same requests.", ""] + _table(
        ["", "glmjax", "transformers", "floor", "glmjax / floor"], rows)


def engine_bench(r) -> list[str]:
    rows = []
    for b in (8, 64):
        k = f"decode_b{b}"
        if f"{k}_steady_tokens_per_s" in r:
            floor = r.get(f"{k}_steady_floor_tokens_per_s")
            rows.append([f"engine decode, batch {b} (steady)", _num(r[f"{k}_steady_tokens_per_s"], "tok/s"),
                         f"transformers {_num(r[f'hf_{k}_steady_tokens_per_s'], 'tok/s')}",
                         _num(floor, "tok/s") if floor else DASH])
    if "mtp_accept_len" in r:
        rows.append(["MTP, 5 drafts, rule corpus (batch 1)", f"{r['mtp_accept_len']:.2f} accepted, "
                     f"{r['mtp_speedup_b1']:.2f}x", "no drafts 1.00x", "5 accepted"])
    if "mtp_accept_len_main_job_b1" in r:
        rows.append(["MTP, 5 drafts, sorting job's base at T=0.5 (batch 1)",
                     f"{r['mtp_accept_len_main_job_b1']:.2f} accepted, {r['mtp_speedup_main_job_b1']:.2f}x",
                     "no drafts 1.00x", "5 accepted"])
    rows.append(["router utilisation, 2 replicas x 8 slots", _num(r["router_utilization"]),
                 f"static batches {_num(r['static_utilization'])}", "1.00"])
    return [_source("engine_bench", "Rollout engine"),
            "configs/small.py for decode (prefill included in the engine's run, left out of the steady figure); "
            "the MTP rows are accepted drafts per step and the speedup over the same engine without drafts.",
            ""] + _table(["", "glmjax", "peer", "floor"], rows)


def dsa_bench(r) -> list[str]:
    if "dsa_vs_dense_prefill_32k" not in r:
        return []
    res, top = r["results"], "32768"
    pre = lambda v, ctx=top: res[v]["prefill"][ctx]["s_per_token"]  # noqa: E731
    dec = lambda v: res[v]["decode"][top]["s_per_step"]  # noqa: E731
    goals = r.get("goals", {})
    goal = lambda k: goals.get(k, {}).get("goal", DASH)  # noqa: E731
    flops = lambda k: f"{r['flops'][k]:.2f}x" if "flops" in r else DASH  # noqa: E731
    rows = [["prefill at 32k, ms per token", _num(1e3 * pre("dsa")), _num(1e3 * pre("dense")),
             f"{r['dsa_vs_dense_prefill_32k']:.2f}x", flops("dsa_vs_dense_prefill_32k"),
             goal("dsa_vs_dense_prefill_32k")],
            ["decode at 32k, ms per step (batch 8)", _num(1e3 * dec("dsa")), _num(1e3 * dec("dense")),
             f"{r['dsa_vs_dense_decode_32k']:.2f}x", DASH, goal("dsa_vs_dense_decode_32k")],
            ["IndexShare prefill at 32k, ms per token", _num(1e3 * pre("indexshare")), f"DSA {_num(1e3 * pre('dsa'))}",
             f"{r['indexshare_vs_dsa_prefill_32k']:.2f}x", flops("indexshare_vs_dsa_prefill_32k"),
             goal("indexshare_vs_dsa_prefill_32k")],
            ["DSA cost per token, 32k over 4k", f"{r['dsa_per_token_32k_over_4k']:.2f}x",
             f"dense {pre('dense') / pre('dense', '4096'):.2f}x", DASH, flops("dsa_per_token_32k_over_4k"),
             goal("dsa_per_token_32k_over_4k")]]
    return [_source("dsa_bench", "Sparse attention"),
            "A 4-layer model with GLM-5's attention at a quarter of its widths, XLA path, wall time; the plot is "
            "[results/dsa_bench.png](results/dsa_bench.png). \"in FLOPs\" is the same ratio if every arm ran at one "
            "rate (benchmarks/floor.py's count).", ""] + _table(
        ["", "DSA", "dense (peer)", "DSA speedup", "in FLOPs", "goal"], rows)


def cpu_primitives(r) -> list[str]:
    c, k, fresh = r["ceiling"], r["top_k"], r["fresh_output"]

    def expert(rows: int, how: str, field: str, unit: str, ceiling: str) -> list[str]:
        e = r["experts"][f"{rows}_rows_{how}"]
        return [f"{rows} row{'s' if rows > 1 else ''} per expert, weights {how.replace('_', ' ')}",
                _num(e[field], unit), _num(c[ceiling], unit), _num(e["fraction"])]

    reads, flops = ("gb_per_s", "GB/s", "read_gb_per_s"), ("gflops", "GFLOP/s", "matmul_gflops")
    rows = [expert(1, "in_place", *reads), expert(1, "sliced", *reads), expert(8, "in_place", *reads),
            expert(8, "sliced", *reads), expert(128, "sliced", *flops),
            [f"top-{k['k']} of a row, one core", f"{k['ns_per_key']:.1f} ns per key + {_num(k['us_per_row'])} us "
             "per row", DASH, DASH],
            ["two top-ks in one loop step", f"{r['loop_body']['two_over_one']:.2f}x one", "1.00x on two cores", DASH],
            ["writing a fresh 256 MB output", f"{_num(fresh['write_ms_per_gb'])} ms/GB",
             f"reading it {_num(fresh['read_ms_per_gb'])} ms/GB", DASH]]
    shape = r["expert_shape"]
    return [_source("cpu_primitives", "What XLA:CPU reaches"),
            f"The pieces the figures above are made of: products of configs/small.py's [{shape['in']}, "
            f"{shape['out']}] expert matrices (weights cold; \"sliced\" is the tile loop's `w[e]`, which "
            "XLA:CPU copies before the dot), the indexer's top-k, and a loop body's independent ops (run one after "
            "the other). The fraction bounds a weight-bound step's `glmjax / floor`.", ""] + _table(
        ["", "measured", "ceiling", "fraction"], rows)


def rl_bench(r) -> list[str]:
    h = r["throughput"][f"batch{r['headline_batch']}"]
    return [_source("rl_bench", "Asynchronous RL"), f"The sorting job's loop at batch {r['headline_batch']}.", ""] + _table(
        ["", "asynchronous", "synchronous (peer)", "bound"],
        [["rollouts per second", _num(h["async_rollouts_per_s"]), _num(h["sync_rollouts_per_s"]),
          f"{h['bound']:.2f}x sync"],
         ["async over sync", f"{r['async_vs_sync_throughput']:.2f}x", "1.00x", f"{h['bound']:.2f}x"],
         ["learner busy", _pct(r["learner_busy_fraction"]), _pct(h["runs"]["sync"][0]["learner_busy_fraction"]),
          "100%"]])


def agent_bench(r) -> list[str]:
    m = r["median"]
    return [_source("agent_bench", "Agentic rollouts"),
            f"{r['config']['episodes']} episodes of {r['config']['turns']} turns, commands with log-normal latency "
            f"(median {r['config']['delay_ms']:.0f} ms).", ""] + _table(
        ["", "asynchronous", "synchronous (peer)"],
        [["episodes per second", _num(m["async"]["episodes_per_s"]), _num(m["sync"]["episodes_per_s"])],
         ["engine busy while environments run", _pct(m["async"]["engine_busy_fraction"]),
          _pct(m["sync"]["engine_busy_fraction"])],
         ["history tokens not prefilled again", _pct(m["async"]["history_tokens_reused_fraction"]),
          _pct(m["sync"]["history_tokens_reused_fraction"])]])


def opd_bench(r) -> list[str]:
    return [_source("opd_bench", "Teacher switching in distillation"), f"{r['teachers']} teachers, {r['switches']} "
            f"switches.", ""] + _table(
        ["", "with prefetch", "cold loads (peer)"],
        [["stall per switch", _num(1e3 * r["prefetched_stall_seconds"], "ms"),
          _num(1e3 * r["cold_switch_stall_seconds"], "ms")],
         ["teacher idle share", _pct(r["teacher_idle_share"]), _pct(r["teacher_idle_share_cold"])],
         ["schedule time", _num(r["schedule_seconds"], "s"), _num(r["schedule_seconds_cold"], "s")]])


def sharding_bench(r) -> list[str]:
    arms = r["rl_step"]["arms"]
    pub = r["publish"]["configs/small.py"]
    load = r["sharded_load"]["runs"][-1]
    one = f"one device {_num(arms['one_device']['step_s'], 's')}"
    shown = [name for name in arms if name != "one_device"][:1] + [name for name in arms if "disjoint" in name]

    def where(sizes):
        return " x ".join(f"{k}={v}" for k, v in sizes.items())

    def label(name):
        a = arms[name]
        if "engine_mesh" not in a:
            return f"RL step on {where(a['mesh'])}"
        n = math.prod(a["mesh"].values())
        return f"RL step, learner {where(a['mesh'])} on devices 0-{n - 1}, engine {where(a['engine_mesh'])} on {n}-{2 * n - 1}"

    rows = [[label(name), _num(arms[name]["step_s"], "s"), one] for name in shown]
    rows += [["publish weights, small (same layout / reshard)", _num(pub["same_layout_swap_ms"], "ms"),
              f"reshard {_num(pub['reshard_same_devices_ms'], 'ms')}"],
             ["sharded checkpoint load, memory above the arrays", _pct(load["peak_anonymous_excess_over_checkpoint"]),
              "goal 25%"]]
    return [_source("sharding_bench", "Meshes (8 CPU devices)"), ""] + _table(["", "glmjax", "peer"], rows)


def main_jobs() -> list[str]:
    rows = []
    for name, label in (("main_job_seeds", "configs/sao_tiny.py (sorting)"),
                        ("agent_main_job_seeds", "configs/sao_agent_tiny.py (shell episodes)")):
        r = _load(name)
        if r is None:
            continue
        runs = r["runs"]
        rows.append([label, ", ".join(_pct(x["base_pass_rate"]) for x in runs),
                     ", ".join(_pct(x["final_pass_rate"]) for x in runs), f"{r['points_mean']:+.1f} pt",
                     _num(sum(x["wall_seconds"] for x in runs) / len(runs) / 60, "min"),
                     "yes" if r["all_meet_plus_50_percent_and_15_points"] else "no"])
    if not rows:
        return []
    return ["**Main jobs** (`benchmarks/main_job_seeds.py`, [results/main_job_seeds.json](results/main_job_seeds.json), "
            "[results/agent_main_job_seeds.json](results/agent_main_job_seeds.json)): held-out pass rates of three "
            "runs, seeds 0, 1 and 2, in fresh workdirs.", ""] + _table(
        ["job", "base", "after SAO", "mean change", "minutes per run", "+50% and +15 pt in all"], rows)


def plans() -> list[str]:
    rows = []
    for label, name in (("64 x H200 (141 GB)", "plan_h200x64"), ("256 x TPU v5p (95 GB)", "plan_v5p256")):
        p = _load(name)
        if p is None:
            continue
        mesh = ", ".join(f"{k}={v}" for k, v in p["mesh"].items() if v > 1)
        fits = "yes" if p["fits_training"] and p["fits_serving"] and p["fits_rl"] else "no"
        rows.append([label, mesh, _num(p["train_total"] / 1e9, "GB"), _num(p["serve_total"] / 1e9, "GB"),
                     _num(p["rl_total"] / 1e9, "GB"), fits])
    if not rows:
        return []
    return ["**Memory plan for GLM-5.3** (`python -m glmjax.plan --config configs/glm53.py`, "
            "[results/plan_h200x64.json](results/plan_h200x64.json)): per device, RL = the policy's training share, "
            "the critic, the rollout engine's KV cache.", ""] + _table(
        ["hardware", "mesh", "training", "serving", "RL", "fits"], rows)


def ablations(r) -> list[str]:
    m = r["machine"]
    rows = []
    for title, c in r["comparisons"].items():
        base, variant = (r["arms"][a] for a in c["arms"][:2])
        change = lambda a: f"{_pct(a['base_pass_rate'])} -> {_pct(a['final_pass_rate'])}"  # noqa: E731
        rows.append([title, f"{c['labels'][0]}: {change(base)}", f"{c['labels'][1]}: {change(variant)}"])
    return [f"**Ablations** ([notebooks/ablations.ipynb](notebooks/ablations.ipynb), "
            f"[results/ablations.json](results/ablations.json)): held-out pass rates before and after "
            f"{r['rl_steps']} RL steps per arm, one seed, {m['cpus']} CPU cores, {r['notebook_seconds'] / 60:.0f} "
            f"minutes in all; a demonstration of the knobs rather than a result about the methods.", ""] + _table(
        ["comparison", "baseline", "variant"], rows)


def gpu_kernels(r) -> list[str]:
    if r.get("smoke", True):
        return []
    headline = ("flash_mla_prefill fwd", "absorbed_mla prefill", "absorbed_mla decode", "indexer scores bf16",
                "sparse_mla prefill fwd")
    rows = [[c["case"], _num(c["ms"], "ms"), _num(c["tflops"], "TFLOP/s"), f"{c['pct_flops']:.1f}%",
             _num(c["gbps"], "GB/s"), f"{c['pct_bw']:.1f}%"] for c in r["cases"] if c["case"] in headline]
    ok = sum(c["ok"] for c in r["cases"])
    return [f"**Pallas kernels on one {r['device']}** (`benchmarks/gpu_kernels.py`, "
            f"[results/gpu_kernels.json](results/gpu_kernels.json)): GLM-5's attention shapes in bf16 (4,096-token "
            f"prefill, 32 decode sequences of up to 32,768 keys, top-2,048); {ok} of {len(r['cases'])} kernels "
            f"match their fp32 references within {r['tolerance']:g} of the largest value. Percentages are of the "
            "chip's dense bf16 peak and HBM bandwidth.", ""] + _table(
        ["kernel", "time", "compute", "of peak", "traffic", "of bandwidth"], rows)


def gpu_model(r) -> list[str]:
    rows = []
    for key, label in (("prefill", f"prefill, {r['prefill']['tokens']:,} tokens"),
                       ("train_step", f"training step, {r['train_step']['tokens']:,} tokens"),
                       ("decode", f"greedy decode, batch {r['decode']['batch']}, {r['decode']['new_tokens']} tokens")):
        rows.append([label, _num(r[key]["xla"]["median_s"] * 1e3, "ms"), _num(r[key]["pallas"]["median_s"] * 1e3, "ms"),
                     f"{r[f'{key}_pallas_speedup']:.2f}x"])
    return [f"**The model on one {r['device']}** (`benchmarks/gpu_model.py`, [results/gpu_model.json]"
            f"(results/gpu_model.json)): `configs/small.py` in bf16, `kernel_impl=\"pallas\"` against `\"xla\"` on the "
            f"same weights; in float32 the two agree on {100 * r['f32_argmax_agreement_pallas_vs_xla']:.2f}% of "
            "next tokens.", ""] + _table(["", "xla", "pallas", "speedup"], rows)


SECTIONS = (("model_bench", model_bench), ("engine_bench", engine_bench), ("dsa_bench", dsa_bench),
            ("cpu_primitives", cpu_primitives), ("rl_bench", rl_bench), ("agent_bench", agent_bench),
            ("opd_bench", opd_bench),
            ("sharding_bench", sharding_bench), ("gpu_kernels", gpu_kernels), ("gpu_model", gpu_model))


def render() -> str:
    parts = []
    for name, fn in SECTIONS:
        if (r := _load(name)) is not None and (lines := fn(r)):
            parts += lines + [""]
    for lines in (main_jobs(), plans()):
        if lines:
            parts += lines + [""]
    if (r := _load("ablations")) is not None:
        parts += ablations(r) + [""]
    return "\n".join(parts).rstrip() + "\n"


def main():
    readme = REPO / "README.md"
    text = readme.read_text()
    block = f"{BEGIN}\n{render()}{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)
    print(render())


if __name__ == "__main__":
    main()
