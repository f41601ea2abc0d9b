"""Matmul FLOPs of a compiled XLA program, with each while loop's body counted once per trip.

`compiled.cost_analysis()` walks a while loop's body once, whatever its trip count: for a
model whose layers run under `lax.scan` (and whose attention, LM head and MoE exchanges
loop over blocks) it misses most of the work. `matmul_flops(compiled.as_text())` reads the
optimized HLO instead and sums, per computation,

  dot            2 x (output elements) x (product of the lhs contracting dimensions)
  convolution    2 x (input features / feature groups) x (output features)
                 x (batch / batch groups) x (valid window positions per spatial dimension),
                 as XLA's HloCostAnalysis::GetConvolutionFlops counts them
  custom-call    the "flops" of its cost estimate (Pallas kernels, megablox)
  fusion, call   the FLOPs of the computation they call
  conditional    the largest branch's
  while          trip count x its body's, the trip count read from the loop's condition
                 (`i < N` on a counter whose start is a constant, or a copy of one, in the
                 loop's init tuple)

Elementwise work is not counted: the figure compares with a model's own matmul count
(rl/model_flops.py: analytic_flops). A loop whose trip count cannot be read counts once and is
listed in `unknown_trip_counts`.
"""

from __future__ import annotations

import dataclasses
import math
import re

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_ARRAY = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # as printed: "bf16[8,128]{1,0}" or a tuple "(s32[], ...)"
    opcode: str
    args: str  # the text between the opcode's parentheses: operands, or a constant's value
    attrs: str

    @property
    def operands(self) -> list[str]:
        return _NAME.findall(self.args)

    @property
    def dims(self) -> list[int]:
        m = _ARRAY.match(self.shape)
        if m is None:
            raise ValueError(f"{self.name}: not an array shape: {self.shape[:80]}")
        return [int(d) for d in m.group(1).split(",") if d]


@dataclasses.dataclass
class Report:
    flops: float
    unknown_trip_counts: list[str]


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket group that opens at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets from: {text[start:start + 80]}")


def _instruction(line: str) -> Instruction | None:
    m = _DEF.match(line)
    if m is None:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple shape
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    close = _balanced(rest, op.end() - 1)
    return Instruction(m.group(1), shape, op.group(1), rest[op.end():close - 1], rest[close:])


def parse(hlo: str) -> dict[str, list[Instruction]]:
    """The module's computations by name, each its instructions in order."""
    computations, current = {}, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header is not None:
            current = computations.setdefault(header.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            ins = _instruction(line)
            if ins is not None:
                current.append(ins)
    return computations


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=", attrs)
    if m is None:
        return None
    start = m.end()
    if attrs[start] in "{(":
        return attrs[start:_balanced(attrs, start)]
    end = re.search(r"[,\s]|$", attrs[start:]).start()
    return attrs[start:start + end]


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text or "")]


def dot_flops(ins: Instruction, shapes: dict[str, list[int]]) -> float:
    lhs = shapes[ins.operands[0]]
    contracting = _ints(_attr(ins.attrs, "lhs_contracting_dims"))
    return 2.0 * math.prod(ins.dims) * math.prod(lhs[d] for d in contracting)


def _window(attrs: str, rank: int) -> list[dict]:
    """Per spatial dimension: size, stride, padding, base (lhs) and window (rhs) dilation."""
    text = (_attr(attrs, "window") or "{}")[1:-1]
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    def split(key, default):
        return [int(v) for v in fields[key].split("x")] if key in fields else [default] * rank

    pads = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else \
        [(0, 0)] * rank
    return [dict(size=s, stride=st, pad=p, base=bd, dilation=wd) for s, st, p, bd, wd in zip(
        split("size", 1), split("stride", 1), pads, split("lhs_dilate", 1), split("rhs_dilate", 1))]


def _valid_positions(input_len: int, kernel_len: int, output_len: int, w: dict) -> int:
    """(output, kernel) index pairs of one spatial dimension that read a real input element."""
    count = 0
    for k in range(kernel_len):
        for o in range(output_len):
            undilated = o * w["stride"] - w["pad"][0] + k * w["dilation"]
            if undilated % w["base"]:
                continue
            i = undilated // w["base"]
            count += 0 <= i < input_len
    return count


def conv_flops(ins: Instruction, shapes: dict[str, list[int]]) -> float:
    lhs, rhs, out = shapes[ins.operands[0]], shapes[ins.operands[1]], ins.dims
    labels = _attr(ins.attrs, "dim_labels")
    lhs_l, rest = labels.split("_", 1)
    rhs_l, out_l = rest.split("->")
    spatial = sorted(c for c in lhs_l if c.isdigit())
    valid = 1
    for dim, w in zip(spatial, _window(ins.attrs, len(spatial))):
        valid *= _valid_positions(lhs[lhs_l.index(dim)], rhs[rhs_l.index(dim)], out[out_l.index(dim)], w)
    features = int(_attr(ins.attrs, "feature_group_count") or 1)
    batches = int(_attr(ins.attrs, "batch_group_count") or 1)
    fma = lhs[lhs_l.index("f")] // features * out[out_l.index("f")] * (lhs[lhs_l.index("b")] // batches) * valid
    return 2.0 * fma


def custom_call_flops(ins: Instruction) -> float:
    m = re.search(r'"cost_estimate":\{[^}]*"flops":"?(\d+)', ins.attrs)
    return float(m.group(1)) if m else 0.0


def _trip_count(loop: Instruction, computations, by_name) -> int | None:
    """N - start for a condition `counter < N` (N a constant; start the constant the
    loop's init tuple gives the counter), or None."""
    cond = computations.get((_attr(loop.attrs, "condition") or "%").lstrip("%"))
    if not cond:
        return None
    local = {i.name: i for i in cond}
    root = cond[-1]
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = _attr(root.attrs, "direction")
    a, b = (local.get(n) for n in root.operands)
    if direction == "GT":
        a, b, direction = b, a, "LT"
    if direction not in ("LT", "LE") or a is None or b is None:
        return None
    if a.opcode != "get-tuple-element" or b.opcode != "constant":
        return None
    limit = int(b.args)
    index = int(_attr(a.attrs, "index"))
    init = by_name.get(loop.operands[0])
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = by_name.get(init.operands[index])
    while start is not None and start.opcode in ("copy", "bitcast") and start.operands:  # a copy of the start
        start = by_name.get(start.operands[0])
    if start is None or start.opcode != "constant":
        return None
    return limit - int(start.args) + (direction == "LE")


def matmul_flops(hlo: str) -> Report:
    """The matmul FLOPs of the module in `hlo` (`compiled.as_text()`), loops by trip count."""
    computations = parse(hlo)
    by_name = {i.name: i for body in computations.values() for i in body}
    shapes = {}
    for name, ins in by_name.items():
        if _ARRAY.match(ins.shape):
            shapes[name] = ins.dims
    report = Report(0.0, [])
    memo: dict[str, float] = {}

    def flops_of(name: str) -> float:
        if name in memo:
            return memo[name]
        total = 0.0
        for ins in computations.get(name, ()):
            if ins.opcode == "dot":
                total += dot_flops(ins, shapes)
            elif ins.opcode == "convolution":
                total += conv_flops(ins, shapes)
            elif ins.opcode == "custom-call":
                total += custom_call_flops(ins)
            elif ins.opcode in ("fusion", "call", "async-start"):
                called = _attr(ins.attrs, "calls") or _attr(ins.attrs, "to_apply")
                total += sum(flops_of(n) for n in _NAME.findall(called or ""))
            elif ins.opcode == "conditional":
                branches = _attr(ins.attrs, "branch_computations")
                names = _NAME.findall(branches) if branches else [
                    (_attr(ins.attrs, k) or "%").lstrip("%") for k in ("true_computation", "false_computation")]
                total += max((flops_of(n) for n in names if n), default=0.0)
            elif ins.opcode == "while":
                trips = _trip_count(ins, computations, by_name)
                if trips is None:
                    report.unknown_trip_counts.append(ins.name)
                body = (_attr(ins.attrs, "body") or "%").lstrip("%")
                total += (1 if trips is None else max(trips, 0)) * flops_of(body)
        memo[name] = total
        return total

    entry = next(m.group(1) for line in hlo.splitlines() if (m := re.match(r"^ENTRY %?([\w.\-]+) ", line)))
    report.flops = flops_of(entry)
    return report
