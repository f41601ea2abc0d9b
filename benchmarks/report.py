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
    out = ["`python -m glmjax.plan --config configs/glm53.py` (GB per device):", "",
           "| hardware | mesh | params | optimizer | activations | training | KV cache | serving | fits |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for label, p in plans:
        mesh = ", ".join(f"{k}={v}" for k, v in p["mesh"].items() if v > 1)
        g = lambda key: f"{p[key] / 1e9:.1f}"  # noqa: E731
        fits = "yes" if p["fits_training"] and p["fits_serving"] else "no"
        out.append(f"| {label} | {mesh} | {g('params')} | {g('optimizer')} | {g('activations')} | "
                   f"{g('train_total')} | {g('kv_cache')} | {g('serve_total')} | {fits} |")
    return out


def generic_table(name, r) -> list[str]:
    flat = {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out = [f"`benchmarks/{name}.py`:", "", "| figure | value |", "| --- | ---: |"]
    out += [f"| {k} | {v:,.4g} |" for k, v in flat.items()]
    return out


def render() -> str:
    parts = []
    if (r := _load("model_bench")) is not None:
        parts += model_table(r) + [""]
    plans = [(label, p) for label, name in (("64 x H200 (141 GB)", "plan_h200x64"), ("256 x TPU v5p (95 GB)",
                                                                                     "plan_v5p256"))
             if (p := _load(name)) is not None]
    if plans:
        parts += plan_table(plans) + [""]
    for name in ("dsa_bench", "engine_bench", "rl_bench", "env_bench", "sharding_bench"):
        if (r := _load(name)) is not None:
            parts += generic_table(name, r) + [""]
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
