"""The blockwise online-softmax core shared by the dense MLA kernels (FlashAttention-2,
Dao 2023), forward and backward, in the shape both MLA forms reduce to:

    o[n, m] = sum_s softmax_s(scale * (q1[n, m] . k1[n, s] + q2[n, m] . k2[n, s])) v[n, s]

over the keys s <= pos[n, m] (and, optionally, only those whose bit is set in a per-row
bit mask). Rows m are whatever the caller flattens: (token, head) pairs for absorbed MLA,
whose single key k1 | k2 = c_kv | k_rope is shared by every head and whose value is k1
itself (`shared_kv`); tokens of one head for expanded MLA, where n runs over (batch, head).

Forward (grid N x row blocks x key splits): each program walks its key blocks up to the
last one its rows can see, keeping the running max m, denominator l and unnormalised
output in fp32 (the paper's Algorithm 1). With several splits each covers a slice of the
keys and the caller merges the partial results by their log-sum-exp (flash decoding).
Backward (Algorithm 2, with delta = rowsum(o * do)): one kernel for dq walks the key
blocks; one for dk / dv walks the row blocks, skipping those whose rows see none of its keys.

Arrays arrive padded: rows to a multiple of block_m, keys to a multiple of block_k, feature
widths to powers of two; padding rows have pos = -1 and see nothing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._backend import NEG, blocks_to, call, mm, mm_nt, mm_tn

BITS = 32  # keys per mask word; a masked call uses key blocks of exactly one word


class Layout(NamedTuple):
    """Static structure of one call."""

    block_m: int
    block_k: int
    has_q2: bool  # a second (rope) part of the query / key
    shared_kv: bool  # the value is k1 (absorbed MLA)
    has_bits: bool  # a selection bit mask [N // bits_group, M, S // 32]
    bits_group: int  # rows of n share the mask of n // bits_group (the heads of one batch)


def _mask(layout: Layout, pos, key_start, bits_word):
    """[block_m, block_k] visibility of keys key_start + [0, block_k) to rows at pos."""
    keys = key_start + jax.lax.broadcasted_iota(jnp.int32, (1, layout.block_k), 1)
    visible = keys <= pos[:, None]
    if bits_word is not None:
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, layout.block_k), 1)
        visible &= jax.lax.shift_right_logical(bits_word, lane) & 1 == 1
    return visible


def _unpack(layout: Layout, refs, names):
    """Maps the flat ref list to names, skipping the optional ones this layout lacks."""
    skip = set()
    if not layout.has_q2:
        skip |= {"q2", "k2", "dq2", "dk2"}
    if layout.shared_kv:
        skip |= {"v", "dv"}
    if not layout.has_bits:
        skip |= {"bits"}
    names = [n for n in names if n not in skip]
    assert len(names) == len(refs), (names, len(refs))
    return dict(zip(names, refs))


def _scores(layout, q1, q2, k1, k2, scale):
    s = mm_nt(q1, k1)
    if layout.has_q2:
        s += mm_nt(q2, k2)
    return s * scale


def _load_keys(layout, r, j):
    """Key block j: k1, k2 (None without a second part) and v (k1 when shared)."""
    ks = pl.ds(j * layout.block_k, layout.block_k)
    k1 = r["k1"][ks, :]
    k2 = r["k2"][ks, :] if layout.has_q2 else None
    return k1, k2, k1 if layout.shared_kv else r["v"][ks, :]


_FWD_IN = ("q1", "q2", "k1", "k2", "v", "pos", "bits")


def _forward_kernel(*refs, layout: Layout, scale: float, splits: int):
    r = _unpack(layout, refs, _FWD_IN + ("o", "lse"))
    q1 = r["q1"][...]
    q2 = r["q2"][...] if layout.has_q2 else None
    pos = r["pos"][...]
    num_blocks = r["k1"].shape[0] // layout.block_k
    per_split = -(-num_blocks // splits)
    lo = pl.program_id(2) * per_split
    hi = jnp.minimum(jnp.minimum(lo + per_split, num_blocks), blocks_to(jnp.max(pos) + 1, layout.block_k))

    def body(j, carry):
        acc, m_prev, l_prev = carry
        k1, k2, v = _load_keys(layout, r, j)
        bits = r["bits"][:, pl.ds(j, 1)] if layout.has_bits else None
        visible = _mask(layout, pos, j * layout.block_k, bits)
        s = jnp.where(visible, _scores(layout, q1, q2, k1, k2, scale), NEG)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        correction = jnp.exp(m_prev - m_next)
        acc = acc * correction[:, None] + mm(p.astype(v.dtype), v)
        return acc, m_next, l_prev * correction + jnp.sum(p, axis=1)

    dv = r["o"].shape[-1]
    init = (jnp.zeros((layout.block_m, dv), jnp.float32), jnp.full((layout.block_m,), NEG, jnp.float32),
            jnp.zeros((layout.block_m,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), body, init)
    seen = l > 0
    r["o"][...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(r["o"].dtype)
    r["lse"][...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG)


def _in_specs(layout: Layout, order, arrays, *, whole_rows: bool):
    """BlockSpecs over grid (n, i, ...): row operands by row block i (or whole, for the
    dk / dv kernel whose grid axis 1 runs over key blocks), keys always whole."""
    bm, g = layout.block_m, layout.bits_group
    specs = []
    for name, x in zip(order, arrays):
        if name in ("k1", "k2", "v"):
            specs.append(pl.BlockSpec((None,) + x.shape[1:], lambda n, *_: (n, 0, 0)))
        elif whole_rows:
            if name == "bits":
                specs.append(pl.BlockSpec((None,) + x.shape[1:], lambda n, *_: (n // g, 0, 0)))
            elif x.ndim == 3:
                specs.append(pl.BlockSpec((None,) + x.shape[1:], lambda n, *_: (n, 0, 0)))
            else:
                specs.append(pl.BlockSpec((None, x.shape[1]), lambda n, *_: (n, 0)))
        elif name == "bits":
            specs.append(pl.BlockSpec((None, bm, x.shape[-1]), lambda n, i, *_: (n // g, i, 0)))
        elif x.ndim == 3:
            specs.append(pl.BlockSpec((None, bm, x.shape[-1]), lambda n, i, *_: (n, i, 0)))
        else:
            specs.append(pl.BlockSpec((None, bm), lambda n, i, *_: (n, i)))
    return specs


def _inputs(layout: Layout, **arrays):
    order = [n for n in _FWD_IN + ("do", "lse", "delta") if arrays.get(n) is not None]
    return order, [arrays[n] for n in order]


def forward(layout: Layout, q1, q2, k1, k2, v, pos, bits, *, scale: float, splits: int, out_dtype, backend: str):
    """o [N, splits, M, Dv] (out_dtype; fp32 when splits > 1) and lse [N, splits, M] fp32."""
    n, m, _ = q1.shape
    order, args = _inputs(layout, q1=q1, q2=q2, k1=k1, k2=k2, v=None if layout.shared_kv else v, pos=pos, bits=bits)
    dv = k1.shape[-1] if layout.shared_kv else v.shape[-1]
    bm = layout.block_m
    return call(
        functools.partial(_forward_kernel, layout=layout, scale=scale, splits=splits),
        backend=backend,
        grid=(n, m // bm, splits),
        in_specs=_in_specs(layout, order, args, whole_rows=False),
        out_specs=[pl.BlockSpec((None, None, bm, dv), lambda b, i, s: (b, s, i, 0)),
                   pl.BlockSpec((None, None, bm), lambda b, i, s: (b, s, i))],
        out_shape=[jax.ShapeDtypeStruct((n, splits, m, dv), out_dtype),
                   jax.ShapeDtypeStruct((n, splits, m), jnp.float32)],
        name="mla_flash_forward",
        num_warps=4 if dv <= 128 else 8,
    )(*args)


def merge_splits(o, lse):
    """Combines per-split results o [N, P, M, Dv], lse [N, P, M] -> [N, M, Dv], [N, M]."""
    if o.shape[1] == 1:
        return o[:, 0], lse[:, 0]
    top = jnp.max(lse, axis=1, keepdims=True)
    weight = jnp.exp(lse - top)  # [N, P, M]
    total = jnp.sum(weight, axis=1)
    out = jnp.einsum("NPM,NPMV->NMV", weight, o.astype(jnp.float32)) / total[..., None]
    return out, top[:, 0] + jnp.log(total)


_BWD_IN = ("q1", "q2", "k1", "k2", "v", "pos", "bits", "do", "lse", "delta")


def _probs(layout, q1, q2, keys, do, pos, lse, delta, bits, key_start, scale):
    """p and ds = p * (dp - delta), both [block_m, block_k], of loaded rows against keys."""
    k1, k2, v = keys
    visible = _mask(layout, pos, key_start, bits)
    p = jnp.where(visible, jnp.exp(_scores(layout, q1, q2, k1, k2, scale) - lse[:, None]), 0.0)
    return p, p * (mm_nt(do, v) - delta[:, None])


def _dq_kernel(*refs, layout: Layout, scale: float):
    r = _unpack(layout, refs, _BWD_IN + ("dq1", "dq2"))
    q1, do, pos, lse, delta = (r[a][...] for a in ("q1", "do", "pos", "lse", "delta"))
    q2 = r["q2"][...] if layout.has_q2 else None
    hi = jnp.minimum(blocks_to(jnp.max(pos) + 1, layout.block_k), r["k1"].shape[0] // layout.block_k)

    def body(j, carry):
        dq1, dq2 = carry
        keys = _load_keys(layout, r, j)
        bits = r["bits"][:, pl.ds(j, 1)] if layout.has_bits else None
        _, ds = _probs(layout, q1, q2, keys, do, pos, lse, delta, bits, j * layout.block_k, scale)
        dq1 = dq1 + mm(ds.astype(keys[0].dtype), keys[0])
        if layout.has_q2:
            dq2 = dq2 + mm(ds.astype(keys[1].dtype), keys[1])
        return dq1, dq2

    init = (jnp.zeros(q1.shape, jnp.float32), jnp.zeros(q2.shape, jnp.float32) if layout.has_q2 else 0.0)
    dq1, dq2 = jax.lax.fori_loop(0, hi, body, init)
    r["dq1"][...] = (dq1 * scale).astype(r["dq1"].dtype)
    if layout.has_q2:
        r["dq2"][...] = (dq2 * scale).astype(r["dq2"].dtype)


def _dkv_kernel(*refs, layout: Layout, scale: float):
    r = _unpack(layout, refs, _BWD_IN + ("dk1", "dk2", "dv"))
    bm, bk = layout.block_m, layout.block_k
    j = pl.program_id(1)
    keys = _load_keys(layout, r, j)

    def body(i, carry):
        rows = pl.ds(i * bm, bm)
        pos = r["pos"][rows]

        def update(carry):
            dk1, dk2, dv = carry
            q1, do, lse, delta = r["q1"][rows, :], r["do"][rows, :], r["lse"][rows], r["delta"][rows]
            q2 = r["q2"][rows, :] if layout.has_q2 else None
            bits = r["bits"][rows, pl.ds(j, 1)] if layout.has_bits else None
            p, ds = _probs(layout, q1, q2, keys, do, pos, lse, delta, bits, j * bk, scale)
            dk1 = dk1 + mm_tn(ds.astype(q1.dtype), q1)
            if layout.has_q2:
                dk2 = dk2 + mm_tn(ds.astype(q2.dtype), q2)
            return dk1, dk2, dv + mm_tn(p.astype(do.dtype), do)

        return jax.lax.cond(jnp.max(pos) >= j * bk, update, lambda c: c, carry)

    init = (jnp.zeros((bk, r["k1"].shape[-1]), jnp.float32),
            jnp.zeros((bk, r["k2"].shape[-1]), jnp.float32) if layout.has_q2 else jnp.zeros((), jnp.float32),
            jnp.zeros((bk, r["do"].shape[-1]), jnp.float32))
    dk1, dk2, dv = jax.lax.fori_loop(0, r["q1"].shape[0] // bm, body, init)
    dk1 = dk1 * scale
    if layout.shared_kv:  # the value is k1: both gradients land on it
        dk1 = dk1 + dv
    else:
        r["dv"][...] = dv.astype(r["dv"].dtype)
    r["dk1"][...] = dk1.astype(r["dk1"].dtype)
    if layout.has_q2:
        r["dk2"][...] = (dk2 * scale).astype(r["dk2"].dtype)


def backward(layout: Layout, q1, q2, k1, k2, v, pos, bits, o, lse, do, *, scale: float, backend: str):
    """Gradients (dq1, dq2, dk1, dk2, dv) of `forward` (splits merged); None for absent parts.
    With shared_kv the value's gradient is included in dk1 and dv is None."""
    n, m, _ = q1.shape
    bm, bk = layout.block_m, layout.block_k
    delta = jnp.einsum("NMV,NMV->NM", o.astype(jnp.float32), do.astype(jnp.float32))
    v = None if layout.shared_kv else v
    order, args = _inputs(layout, q1=q1, q2=q2, k1=k1, k2=k2, v=v, pos=pos, bits=bits, do=do, lse=lse, delta=delta)

    q_parts = [x for x in (q1, q2) if x is not None]
    dqs = call(
        functools.partial(_dq_kernel, layout=layout, scale=scale),
        backend=backend, grid=(n, m // bm), in_specs=_in_specs(layout, order, args, whole_rows=False),
        out_specs=[pl.BlockSpec((None, bm, x.shape[-1]), lambda b, i: (b, i, 0)) for x in q_parts],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in q_parts], name="mla_flash_dq",
    )(*args)

    k_parts = [x for x in (k1, k2 if layout.has_q2 else None, v) if x is not None]
    dks = call(
        functools.partial(_dkv_kernel, layout=layout, scale=scale),
        backend=backend, grid=(n, k1.shape[1] // bk), in_specs=_in_specs(layout, order, args, whole_rows=True),
        out_specs=[pl.BlockSpec((None, bk, x.shape[-1]), lambda b, j: (b, j, 0)) for x in k_parts],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in k_parts], name="mla_flash_dkv",
    )(*args)

    dq1, dq2 = dqs[0], (dqs[1] if layout.has_q2 else None)
    dk1, rest = dks[0], list(dks[1:])
    dk2 = rest.pop(0) if layout.has_q2 else None
    dv = rest.pop(0) if v is not None else None
    return dq1, dq2, dk1, dk2, dv
