"""Bytes each device receives in the collectives of a compiled, loop-free XLA program (a
publish: rl/engine/weights.py), read from its optimized HLO (`compiled.as_text()`):

  all-gather          result - operand      (the device keeps its own piece)
  all-to-all          operand x (n - 1) / n
  collective-permute  result
  reduce-scatter      operand x (n - 1) / n
  all-reduce          operand x 2 (n - 1) / n   (a ring: reduce-scatter, then all-gather)

n is the size of the instruction's replica groups (listed, iota or mesh form). XLA:TPU
lowers a gather over every chip of a v5p slice as an all-reduce of a zero-padded buffer
(even `lax.all_gather` in shard_map), which this counts as the all-reduce it is: twice an
all-gather's bytes (the publish gathers one mesh axis at a time, which stay all-gathers). Asynchronous pairs count once (their
"-start"). Every computation the program holds is counted once: a program with loops
needs rl/hlo_flops.py's trip counts, which this does not apply.
"""

from __future__ import annotations

import collections
import math
import re

from rl.hlo_flops import _attr, _ints, parse

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAYS = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
KINDS = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape as printed ("bf16[8,128]{1,0}", or a tuple of arrays)."""
    return sum(_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAYS.findall(shape) if dtype in _BYTES)


def _group_size(attrs: str, devices: int) -> int:
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh is not None:  # mesh form: mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: the named axes' sizes
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    if iota is not None:  # iota form: [groups, size]<=[devices]
        return int(iota.group(2))
    groups = _attr(attrs, "replica_groups")
    if groups is None:
        return devices
    first = re.search(r"\{([\d,]*)\}", groups[1:])
    return len(_ints(first.group(1))) if first else devices


def received_bytes(hlo: str, devices: int) -> dict:
    """{"bytes": bytes one device receives, "by_kind": {kind: bytes}, "count": {kind: n}}."""
    by_kind, count = collections.Counter(), collections.Counter()
    for instructions in parse(hlo).values():
        shapes = {ins.name: ins.shape for ins in instructions}
        for ins in instructions:
            kind = ins.opcode.removesuffix("-start")
            if kind not in KINDS or ins.opcode.endswith("-done"):
                continue
            operand = sum(shape_bytes(shapes.get(name, "")) for name in ins.operands)
            result = shape_bytes(ins.shape)
            if ins.opcode.endswith("-start") and ins.shape.startswith("("):  # (operand, result, ...) of an async op
                result -= operand
            n = _group_size(ins.attrs, devices)
            share = (n - 1) / n if n > 1 else 0.0
            got = {"all-gather": result - operand, "all-to-all": operand * share, "collective-permute": result,
                   "reduce-scatter": operand * share, "all-reduce": 2 * operand * share}[kind]
            by_kind[kind] += got
            count[kind] += 1
    return {"bytes": float(sum(by_kind.values())), "by_kind": dict(by_kind), "count": dict(count)}
