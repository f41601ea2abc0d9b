"""Regenerates the README's benchmark tables from the JSON files under results/.

    python benchmarks/report.py            # rewrites the block between the markers in README.md

Each benchmark writes its JSON with `--out results/NAME.json`; this script only formats
what is there, so every figure in the README comes from a measured run.
"""

from __future__ import annotations

import json
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


def _load(name):
    path = REPO / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def model_table(r) -> list[str]:
    rows = [("prefill (4 x 512 tokens)", r["prefill_tokens_per_s"], r["hf_prefill_tokens_per_s"],
             r["prefill_speedup_vs_hf"])]
    for b in sorted(r["decode_tokens_per_s"], key=lambda k: int(k[1:])):
        rows.append((f"greedy decode, batch {b[1:]}", r["decode_tokens_per_s"][b], r["hf_decode_tokens_per_s"][b],
                     r[f"decode_{b}_speedup_vs_hf"]))
    out = [f"`benchmarks/model_bench.py`, {r['config']} ({r['params'] / 1e6:.0f}M parameters, fp32, "
           f"{r['cpus']} CPU cores), tokens/s, medians of {r['repeats']} runs:", "",
           "| | glmjax | transformers | speedup |", "| --- | ---: | ---: | ---: |"]
    out += [f"| {name} | {a:,.0f} | {b:,.1f} | {s:.1f}x |" for name, a, b, s in rows]
    return out


def plan_table(plans) -> list[str]:
    out = ["`python -m glmjax.plan --config configs/glm53.py` (GB per device; RL is SAO: the policy's training "
           "share, the critic's parameters and optimizer state, the rollout engine's KV cache and any teachers):", "",
           "| hardware | mesh | options | params | optimizer | activations | training | KV cache | serving | critic "
           "| rollout KV | teachers | RL | fits |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for label, p in plans:
        mesh = ", ".join(f"{k}={v}" for k, v in p["mesh"].items() if v > 1)
        s = p["settings"]
        options = (f"AdamW {s['optimizer_dtype']}, critic {s['critic']}, {s['slots']} x {s['rollout_len']} rollout "
                   f"slots, {s['teachers']} teachers")
        g = lambda key: f"{p[key] / 1e9:.1f}"  # noqa: E731
        critic = f"{(p['critic_params'] + p['critic_optimizer']) / 1e9:.1f}"
        fits = "yes" if p["fits_training"] and p["fits_serving"] and p["fits_rl"] else "no"
        out.append(f"| {label} | {mesh} | {options} | {g('params')} | {g('optimizer')} | {g('activations')} | "
                   f"{g('train_total')} | {g('kv_cache')} | {g('serve_total')} | {critic} | {g('rollout_kv_cache')} | "
                   f"{g('teacher')} | {g('rl_total')} | {fits} |")
    return out


def ablations_table(r) -> list[str]:
    m = r["machine"]
    common = " ".join(f"--config.{o}" for o in r["common_overrides"])
    out = [f"`notebooks/ablations.ipynb` ({r['rl_steps']} RL steps per run, one seed, {m['platform']}, {m['cpus']} "
           f"CPU cores at load average {m['load_average_at_start']:.1f} at the start and "
           f"{m['load_average_at_end']:.1f} at the end; the whole notebook {r['notebook_seconds'] / 60:.1f} minutes), "
           f"greedy held-out pass rates; every arm also has `{common}`:", "",
           "| comparison | arm | config and overrides | base | after RL | change | RL s / step |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for title, c in r["comparisons"].items():
        for arm, label in zip(c["arms"], c["labels"]):
            a = r["arms"][arm]
            command = " ".join([a["config"], *(f"--config.{o}" for o in a["overrides"])])
            out.append(f"| {title} | {label} | `{command}` | {a['base_pass_rate']:.1%} | {a['final_pass_rate']:.1%} | "
                       f"{100 * a['pass_rate_change']:+.1f} pt | {a['rl_seconds_per_step']:.2f} |")
    s = r["indexshare_speed"]
    out += ["", f"IndexShare off (FFFF) against on (FSFS): a forward pass of the base model takes "
                f"{s['indexshare_off']['forward_ms']:.1f} ms against {s['sao']['forward_ms']:.1f} ms "
                f"(batch 64 x 64 tokens, {s['forward_speedup']:.2f}x), an RL step {s['rl_step_speedup']:.2f}x as long."]
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rows_table(rows: dict) -> list[str]:
    """{row name: {column: scalar}} as one table, columns in first-seen order."""
    columns = list(dict.fromkeys(k for row in rows.values() for k, v in row.items() if _number(v)))
    out = ["| | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for name, row in rows.items():
        out.append(f"| {name} | " + " | ".join(f"{row[c]:,.4g}" if _number(row.get(c)) else "" for c in columns) + " |")
    return out


def generic_table(name, r) -> list[str]:
    """The scalar figures as a figure / value table; each dict of dicts (`{"data8": {...}}`) or
    list of dicts (`[{"case": ..., ...}]`) in the file as a table of its own."""
    script = REPO / "benchmarks" / f"{name}.py"
    out = [f"`benchmarks/{name}.py`:" if script.exists() else f"`results/{name}.json`:", ""]
    flat = {k: v for k, v in r.items() if _number(v)}
    if flat:
        out += ["| figure | value |", "| --- | ---: |"] + [f"| {k} | {v:,.4g} |" for k, v in flat.items()] + [""]
    for key, v in r.items():
        rows = None
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            rows = v
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            label = next((k for k, x in v[0].items() if isinstance(x, str)), None)
            rows = {str(x.get(label, i)): x for i, x in enumerate(v)}
        if rows is not None:
            out += [f"{key}:", ""] + _rows_table(rows) + [""]
    return out[:-1]


# Files with a layout of their own come first; every other results/NAME.json follows as a
# generic table. NAME_smoke.json files (toy-size correctness runs) carry no figures to show.
OWN_LAYOUT = ("model_bench", "plan_h200x64", "plan_v5p256", "ablations")
FIRST = ("dsa_bench", "engine_bench", "rl_bench", "opd_bench", "env_bench", "sharding_bench")


def render() -> str:
    parts = []
    if (r := _load("model_bench")) is not None:
        parts += model_table(r) + [""]
    plans = [(label, p) for label, name in (("64 x H200 (141 GB)", "plan_h200x64"), ("256 x TPU v5p (95 GB)",
                                                                                     "plan_v5p256"))
             if (p := _load(name)) is not None]
    if plans:
        parts += plan_table(plans) + [""]
    if (r := _load("ablations")) is not None:
        parts += ablations_table(r) + [""]
    present = sorted(p.stem for p in (REPO / "results").glob("*.json"))
    rest = [n for n in present if n not in OWN_LAYOUT + FIRST and not n.endswith("_smoke")]
    for name in [n for n in FIRST if n in present] + rest:
        parts += generic_table(name, _load(name)) + [""]
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
