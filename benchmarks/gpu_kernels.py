"""Every Pallas kernel on a GPU: checked against its jnp reference, then timed, with the
achieved TFLOP/s and GB/s set against the device's ceilings.

    python benchmarks/gpu_kernels.py --out results/gpu_kernels.json   # on a GPU: < 10 minutes
    python benchmarks/gpu_kernels.py --smoke                          # anywhere: interpret mode, tiny shapes

Shapes are GLM-5's attention (64 heads, a 512 + 64 latent key, 192 + 64 expanded query
/ key, 256-wide values, 32 indexer heads of 128, top-2048) at 4k-32k tokens, bf16, with
the batch or the head count cut so that each case, reference included, fits in a few
seconds. FLOPs count the causal (visible) work only, bytes the minimum traffic (each
input read once, each output written once; gathered rows count once per query), so the
percentages are of the roofline, not of a kernel's own wasted work. --smoke runs the
same cases at toy sizes on the CPU (interpret mode) and checks correctness only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import absorbed_mla, flash_mla, indexer, reference, sparse_mla

# (dense bf16 tensor-core FLOP/s, HBM bytes/s) by device_kind substring.
CEILINGS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12), "L4": (121e12, 0.3e12)}


@dataclasses.dataclass(frozen=True)
class Dims:
    batch: int
    tokens: int  # prefill length (queries = keys)
    context: int  # decode: cached keys per sequence
    heads: int
    latent: int  # C
    rope: int  # R
    nope: int  # K (expanded)
    value: int  # V (expanded)
    index_heads: int
    index_dim: int
    topk: int
    decode_batch: int


FULL = Dims(batch=1, tokens=4096, context=32768, heads=64, latent=512, rope=64, nope=192, value=256,
            index_heads=32, index_dim=128, topk=2048, decode_batch=32)
SMOKE = Dims(batch=1, tokens=40, context=64, heads=4, latent=32, rope=16, nope=24, value=32,
             index_heads=4, index_dim=32, topk=16, decode_batch=2)


@dataclasses.dataclass
class Case:
    name: str
    args: tuple
    kernel: Callable
    ref: Callable
    flops: float
    bytes: float
    compare: str = "allclose"  # or "selection": the same top-k up to ties


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def cases(d: Dims, dtype, backend: str) -> list[Case]:
    ks = iter(jax.random.split(jax.random.key(0), 64))
    n = lambda *s: _normal(next(ks), s, dtype)  # noqa: E731
    b, t, h, c, r = d.batch, d.tokens, d.heads, d.latent, d.rope
    item = jnp.dtype(dtype).itemsize
    scale = (d.nope + d.rope) ** -0.5
    prefill_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    pairs = b * t * (t + 1) / 2  # visible (query, key) pairs of causal prefill
    out = []

    # 1. Expanded flash prefill (training form), forward and backward; a quarter of the heads.
    he, e, v = max(1, h // 4), d.nope + d.rope, d.value
    q, k, val = n(b, t, he, e), n(b, t, he, e), n(b, t, he, v)
    fwd = lambda q, k, v: flash_mla.flash_mla_prefill(q, k, v, prefill_pos, scale=scale, backend=backend)  # noqa: E731
    ref = lambda q, k, v: reference.mla_attention_expanded(q, k, v, prefill_pos, scale=scale)  # noqa: E731
    io = (2 * q.size + k.size + 2 * val.size) * item
    out.append(Case("flash_mla_prefill fwd", (q, k, val), fwd, ref, 2 * pairs * he * (e + v), io))
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2) / 2, argnums=(0, 1, 2))  # noqa: E731
    out.append(Case("flash_mla_prefill bwd", (q, k, val), grad(fwd), grad(ref), 2.5 * 2 * pairs * he * (e + v),
                    2 * io))
    idx = jax.vmap(jax.vmap(lambda key, p: jnp.where(jnp.arange(d.topk) <= p, jax.random.randint(
        key, (d.topk,), 0, p + 1), -1)))(jax.random.split(next(ks), (b, t)), prefill_pos).astype(jnp.int32)
    idx = jax.vmap(jax.vmap(lambda row: jnp.where(_first_occurrence(row), row, -1)))(idx)
    fwd_k = lambda q, k, v: flash_mla.flash_mla_prefill(q, k, v, prefill_pos, idx, scale=scale, backend=backend)  # noqa: E731
    ref_k = lambda q, k, v: reference.mla_attention_expanded(q, k, v, prefill_pos, idx, scale=scale)  # noqa: E731
    out.append(Case("flash_mla_prefill fwd top-k mask", (q, k, val), fwd_k, ref_k, 2 * pairs * he * (e + v), io))

    # 2. Absorbed MLA: causal prefill, and a decode batch with ragged lengths.
    qc, qr, ckv, kr = n(b, t, h, c), n(b, t, h, r), n(b, t, c), n(b, t, r)
    absorbed = lambda *a: absorbed_mla.mla_attention(*a, prefill_pos, scale=scale, backend=backend)  # noqa: E731
    absorbed_ref = lambda *a: reference.mla_attention(*a, prefill_pos, scale=scale)  # noqa: E731
    out.append(Case("absorbed_mla prefill", (qc, qr, ckv, kr), absorbed, absorbed_ref,
                    2 * pairs * h * (2 * c + r), (2 * qc.size + qr.size + ckv.size + kr.size) * item))
    bd, s = d.decode_batch, d.context
    lengths = jnp.linspace(s // 4, s, bd).astype(jnp.int32)
    dpos = (lengths - 1)[:, None]
    dq = (n(bd, 1, h, c), n(bd, 1, h, r), n(bd, s, c), n(bd, s, r))
    decode = lambda *a: absorbed_mla.mla_attention(*a, dpos, scale=scale, backend=backend)  # noqa: E731
    decode_ref = lambda *a: reference.mla_attention(*a, dpos, scale=scale)  # noqa: E731
    keys_read = float(jnp.sum(lengths))
    out.append(Case("absorbed_mla decode", dq, decode, decode_ref, 2 * keys_read * h * (2 * c + r),
                    keys_read * (c + r) * item))

    # 3. Lightning indexer: causal scores (+ top-k in XLA), bf16 and fp8 e4m3.
    g, i = d.index_heads, d.index_dim
    qi, wi, ki = n(b, t, g, i), _normal(next(ks), (b, t, g), jnp.float32), n(b, t, i)
    # fp8 inputs that e4m3 holds exactly (see _fp8_exact): the kernel's scaled fp8 products
    # are then checked, not how two XLA programs round the same value to e4m3.
    qe, ke = _fp8_exact(next(ks), (b, t, g, i)), _fp8_exact(next(ks), (b, t, i))
    for fp8 in (False, True):
        score = lambda q, w, k, fp8=fp8: indexer.indexer_scores(q, w, k, prefill_pos, fp8=fp8, backend=backend)  # noqa: E731
        score_ref = (lambda q, w, k: reference.indexer_scores(_fp8(q), w, _fp8(k), prefill_pos)) if fp8 else (
            lambda q, w, k: reference.indexer_scores(q, w, k, prefill_pos))
        width = 1 if fp8 else item
        out.append(Case(f"indexer scores {'fp8' if fp8 else 'bf16'}", (qe, wi, ke) if fp8 else (qi, wi, ki), score, score_ref,
                        2 * pairs * g * i, (qi.size + ki.size) * width + b * t * t * 4))
    topk = lambda q, w, k: indexer.indexer_topk(q, w, k, prefill_pos, topk=d.topk, backend=backend)  # noqa: E731
    topk_ref = lambda q, w, k: reference.indexer_scores(q, w, k, prefill_pos)  # noqa: E731  (scores judge the sets)
    out.append(Case("indexer top-k", (qi, wi, ki), topk, topk_ref, 2 * pairs * g * i, b * t * t * 4, "selection"))

    # 4. Sparse MLA over the top-k: prefill forward and backward, decode.
    sel = jnp.minimum(idx, t - 1)
    sparse = lambda *a: sparse_mla.sparse_mla_attention(*a, prefill_pos, sel, scale=scale, backend=backend)  # noqa: E731
    sparse_ref = lambda *a: reference.sparse_mla_attention(*a, prefill_pos, sel, scale=scale)  # noqa: E731
    chosen = float(jnp.sum((sel >= 0) & (sel <= prefill_pos[..., None])))
    gathered = chosen * (c + r) * item
    out.append(Case("sparse_mla prefill fwd", (qc, qr, ckv, kr), sparse, sparse_ref, 2 * chosen * h * (2 * c + r),
                    gathered + 2 * qc.size * item))
    out.append(Case("sparse_mla prefill bwd", (qc, qr, ckv, kr), grad(sparse), grad(sparse_ref),
                    2.5 * 2 * chosen * h * (2 * c + r), 2 * gathered + 4 * qc.size * item))
    didx = jax.vmap(lambda key, ln: jax.random.permutation(key, s)[: d.topk] % ln)(
        jax.random.split(next(ks), bd), lengths)[:, None, :]
    didx = jax.vmap(jax.vmap(lambda row: jnp.where(_first_occurrence(row), row, -1)))(didx).astype(jnp.int32)
    sdec = lambda *a: sparse_mla.sparse_mla_attention(*a, dpos, didx, scale=scale, backend=backend)  # noqa: E731
    sdec_ref = lambda *a: reference.sparse_mla_attention(*a, dpos, didx, scale=scale)  # noqa: E731
    out.append(Case("sparse_mla decode", dq, sdec, sdec_ref, 2 * bd * d.topk * h * (2 * c + r),
                    bd * d.topk * (c + r) * item))
    return out


def _first_occurrence(row):
    """[P] mask of entries whose value did not appear earlier in the row."""
    order = jnp.argsort(row, stable=True)
    srt = row[order]
    first = jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
    return jnp.zeros_like(first).at[order].set(first)


def _fp8_exact(key, shape, block: int = 128):
    """bf16 values that blockwise e4m3 quantisation keeps exactly: e4m3 values whose block
    (of `block` along the last axis) peaks at 448, times a power of two per block, so the
    scale amax / 448 is that power of two and x / scale is the e4m3 value itself."""
    block = min(block, shape[-1])
    k1, k2 = jax.random.split(key)
    v = jnp.clip(jax.random.normal(k1, shape) * 100, -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    v = v.reshape(*shape[:-1], shape[-1] // block, block).at[..., 0].set(448.0)
    e = jax.random.randint(k2, v.shape[:-1] + (1,), -10, -4).astype(jnp.float32)
    return (v * jnp.exp2(e)).reshape(shape).astype(jnp.bfloat16)


def _fp8(x):
    return reference.fp8_dequantize(*reference.fp8_e4m3_blockwise(x))


def _check(case: Case, got, want) -> float:
    """Largest error relative to the reference's largest magnitude (selection: of the scores)."""
    if case.compare == "selection":
        scores, idx = np.asarray(want), np.asarray(got)
        picked = np.where(idx >= 0, np.take_along_axis(scores, np.maximum(idx, 0), -1), -np.inf)
        picked, best = np.sort(picked, -1), np.sort(scores, -1)[..., scores.shape[-1] - idx.shape[-1]:]
        np.testing.assert_array_equal(np.isfinite(picked), np.isfinite(best))
        fin = np.isfinite(best)
        return float(np.max(np.abs(np.where(fin, picked, 0) - np.where(fin, best, 0))) / np.max(np.abs(np.where(fin, best, 0))))
    errs = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        fin = np.isfinite(b)
        np.testing.assert_array_equal(np.isfinite(a), fin)
        a, b = np.where(fin, a, 0), np.where(fin, b, 0)
        errs.append(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return float(max(errs))


def _time(fn, args, min_seconds: float = 0.5, max_iters: int = 50) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    while len(times) < 3 or (sum(times) < min_seconds and len(times) < max_iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(smoke: bool, only: str | None = None) -> dict:
    """Checks (and, on a GPU, times) every case; a case that fails to compile or run is
    reported with its error and the others still run."""
    backend = "cpu" if smoke else jax.default_backend()
    if backend != "gpu" and not smoke:
        raise SystemExit(f"no GPU here (default backend {backend!r}): run with --smoke")
    dims, dtype = (SMOKE, jnp.float32) if smoke else (FULL, jnp.bfloat16)
    tol = 1e-4 if smoke else 3e-2
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in CEILINGS.items() if k in kind), None)
    start = time.perf_counter()
    rows = []
    print(f"device: {kind}; ceilings (FLOP/s, B/s): {peak}")
    print(f"{'case':<34} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} {'GB/s':>8} {'%bw':>6} {'rel err':>9}")
    for case in cases(dims, dtype, backend):
        if only and only not in case.name:
            continue
        row = {"case": case.name, "flops": case.flops, "bytes": case.bytes}
        try:
            kernel, ref = jax.jit(case.kernel), jax.jit(case.ref)
            got = kernel(*case.args)
            with jax.default_matmul_precision("highest"):  # full fp32: a GPU's default runs TF32 passes
                want = ref(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in case.args))
            row["rel_err"] = _check(case, got, want)
            row["ok"] = row["rel_err"] <= tol
            if not smoke:
                seconds = _time(kernel, case.args)
                row.update(ms=seconds * 1e3, tflops=case.flops / seconds / 1e12, gbps=case.bytes / seconds / 1e9)
                if peak:
                    row.update(pct_flops=100 * case.flops / seconds / peak[0],
                               pct_bw=100 * case.bytes / seconds / peak[1])
        except Exception as e:  # noqa: BLE001  (report and go on to the next kernel)
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        rows.append(row)
        fmt = lambda key, spec: format(row[key], spec) if key in row else "-"  # noqa: E731
        print(f"{case.name:<34} {fmt('ms', '9.3f'):>9} {fmt('tflops', '8.1f'):>8} {fmt('pct_flops', '6.1f'):>6} "
              f"{fmt('gbps', '8.0f'):>8} {fmt('pct_bw', '6.1f'):>6} {fmt('rel_err', '9.2e'):>9} "
              f"{'ok' if row['ok'] else 'FAIL ' + row.get('error', '')[:80]}", flush=True)
    return {"device": kind, "ceilings": peak, "smoke": smoke, "dims": dataclasses.asdict(dims),
            "dtype": jnp.dtype(dtype).name, "tolerance": tol, "cases": rows, "seconds": time.perf_counter() - start}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode: correctness only")
    parser.add_argument("--cases", help="only the cases whose name contains this, e.g. 'sparse_mla'")
    args = parser.parse_args()
    report = run(args.smoke, args.cases)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        import results_io  # benchmarks/results_io.py: keeps the file's findings

        results_io.write(args.out, report)
    failed = [r["case"] for r in report["cases"] if not r["ok"]]
    print(f"{len(report['cases']) - len(failed)}/{len(report['cases'])} match their references "
          f"in {report['seconds']:.0f} s")
    if failed:
        raise SystemExit(f"mismatch: {failed}")


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import floor

    floor.main_with_profile(main, "gpu_kernels")  # --profile DIR: a JAX profiler trace of the run
