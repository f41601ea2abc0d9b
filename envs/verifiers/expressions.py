"""The kind ``math``: LaTeX-light normalisation, exact rationals, and sympy equivalence in
capped worker processes (see ``envs/verifiers/__init__.py``)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction
from typing import ClassVar

from envs.base import FULL_REWARD
from envs.verifiers.kind import FieldError, _above, _at_least, _Kind, _needs
from envs.verifiers.text import _close, final_answer

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the folder that holds envs/


@dataclasses.dataclass(frozen=True)
class Math(_Kind):
    expected: str  # normalised (latex_to_expression)
    tolerance: float = 1e-9
    timeout: float = 5.0
    OPTIONS: ClassVar = {"tolerance": float, "timeout": float}

    def __post_init__(self):
        _at_least("tolerance", self.tolerance, 0.0)
        _above("timeout", self.timeout)

    @classmethod
    def build(cls, answer, tests, source, **options) -> Math:
        expected = math_answer(_needs(answer, "math"))
        if not expected:
            raise FieldError("answer", f"no final answer in {answer[-200:]!r}")
        return cls(expected, **options)

    def __call__(self, completion: str) -> float:
        got = math_answer(completion)
        if not got:
            return 0.0
        if got == self.expected:
            return FULL_REWARD
        a, b = _rational(got), _rational(self.expected)
        if a is not None and b is not None:
            return FULL_REWARD if _close(a, b, self.tolerance, 0.0) else 0.0
        if not (_SYMPY_SAFE.fullmatch(got) and _SYMPY_SAFE.fullmatch(self.expected)):
            return 0.0
        return FULL_REWARD if _SYMPY.equal(got, self.expected, self.tolerance, self.timeout) else 0.0



# ----- math: normalisation, exact rationals, sympy in a worker ----------------------------------
_FUNCTIONS = ("sqrt", "pi", "oo", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "log", "ln", "exp")
_SYMBOLS = {"cdot": "*", "times": "*", "div": "/", "pi": "pi", "infty": "oo", "infinity": "oo", "arcsin": "asin",
            "arccos": "acos", "arctan": "atan"}
_DROP = {"left", "right", "displaystyle", "big", "Big", "bigl", "bigr", "Bigl", "Bigr", "limits", "rm"}
_TEXT = {"text", "mathrm", "textbf", "mathbf", "mbox", "textrm", "operatorname", "mathit"}
_SYMPY_SAFE = re.compile(r"[0-9A-Za-z+\-*/()., ]{1,300}")
_COMMAND = re.compile(r"\\([A-Za-z]+)")
_DEGREE = re.compile(r"\s*\[([^\]]*)\]")
_MAX_ANSWER_CHARS = 1000  # a final answer is short; a longer one is not read (nor parsed quadratically)


def _arguments(s: str, i: int, n: int) -> tuple[list[str], int] | None:
    """``n`` LaTeX arguments from position ``i``: ``{...}`` (balanced) or one character each."""
    found = []
    for _ in range(n):
        while i < len(s) and s[i] == " ":
            i += 1
        if i >= len(s):
            return None
        if s[i] != "{":
            found.append(s[i])
            i += 1
            continue
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                break
        else:
            return None
        found.append(s[i + 1:j])
        i = j + 1
    return found, i


def _commands(s: str) -> str:
    """LaTeX commands as plain expression text: ``\\frac{a}{b}`` -> ``((a)/(b))``, ``\\sqrt[n]{x}``,
    ``\\cdot``; ``\\left``/``\\right`` dropped; an unknown ``\\name`` becomes ``name``."""
    out, i = [], 0
    while i < len(s):
        command = _COMMAND.match(s, i)
        if not command:
            out.append(s[i:i + 2] if s[i] == "\\" else s[i])  # \{ stays escaped: a set is not a tuple
            i += 2 if s[i] == "\\" else 1
            continue
        name, i = command.group(1), command.end()
        if name in ("frac", "dfrac", "tfrac"):
            parsed = _arguments(s, i, 2)
            if parsed is None:
                return s
            (top, bottom), i = parsed
            out.append(f"(({_commands(top)})/({_commands(bottom)}))")
        elif name == "sqrt":
            degree = _DEGREE.match(s, i)
            parsed = _arguments(s, degree.end() if degree else i, 1)
            if parsed is None:
                return s
            (body,), i = parsed
            out.append(f"(({_commands(body)})**(1/({_commands(degree.group(1))})))" if degree
                       else f"sqrt({_commands(body)})")
        elif name in _TEXT:
            parsed = _arguments(s, i, 1)
            if parsed is None:
                return s
            (body,), i = parsed
            out.append(_commands(body))
        elif name not in _DROP:
            out.append(f" {_SYMBOLS.get(name, name)} ")
    return "".join(out)


def latex_to_expression(text: str) -> str:
    """An answer in light LaTeX as an expression string (see ``math`` in the package docstring)."""
    s = text.replace("\\$", "").replace("$", "").strip().rstrip(".").strip()
    s = re.sub(r"\\text\{\s[^{}]*\}\s*$", "", s)  # trailing units, as in "5\text{ cm}"
    s = re.sub(r"\\[,;:! ]|\\q?quad\b|~", " ", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|\\%|%", "", s)
    s = _commands(s)
    s = re.sub(r"(?<!\\)\{", "(", re.sub(r"(?<!\\)\}", ")", s)).replace("^", "**")
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    equation = re.fullmatch(r"[A-Za-z]\s*=\s*(.+)", s)
    if equation:
        s = equation.group(1)
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"[A-Za-z]+", lambda m: m.group(0) if m.group(0) in _FUNCTIONS else "*".join(m.group(0)), s)
    return re.sub(r"\s*([-+*/(),])\s*", r"\1", s)


def math_answer(text: str) -> str:
    """The normalised final answer of a text (its last non-empty line when it marks none);
    "" for none, or one longer than ``_MAX_ANSWER_CHARS``."""
    answer = final_answer(text)
    if answer is None:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        answer = lines[-1] if lines else ""
    if len(answer) > _MAX_ANSWER_CHARS:
        return ""
    return latex_to_expression(answer)


def _rational(expression: str) -> Fraction | None:
    """The exact value of an expression of numbers, + - * / and small integer powers; None otherwise."""
    if len(expression) > 200:
        return None
    try:
        return _value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def _value(node) -> Fraction | None:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        return None if inner is None else -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
        a, b = _value(node.left), _value(node.right)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.Pow):
            if b.denominator != 1 or abs(b) > 64 or (a == 0 and b < 0) or \
                    max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(b) > 1 << 16:
                return None
            return a ** int(b)
        return {ast.Add: a.__add__, ast.Sub: a.__sub__, ast.Mult: a.__mul__, ast.Div: a.__truediv__}[type(node.op)](b)
    return None


class _SympyPool:
    """Worker processes that hold sympy, one request each at a time. A request past its
    timeout kills its worker (the next request starts another); each worker caps its own
    address space, so a huge expression ends in a MemoryError there."""

    memory_bytes = 1 << 30

    def __init__(self, size: int):
        self._idle: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(size)

    def equal(self, a: str, b: str, tolerance: float, timeout: float) -> bool:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            try:
                worker = worker or self._start()
                worker.stdin.write(json.dumps({"a": a, "b": b, "tolerance": tolerance}).encode() + b"\n")
                worker.stdin.flush()
                reply = self._read(worker, timeout)
            except OSError:
                reply = None
            if reply is None:
                if worker is not None:
                    worker.kill()
                    worker.wait()
                return False
            with self._lock:
                self._idle.append(worker)
            return reply == b"true\n"

    def _start(self) -> subprocess.Popen:
        code = (f"import sys; sys.path.insert(0, {_ROOT!r}); "
                f"from envs.verifiers.expressions import _serve; _serve({self.memory_bytes})")
        worker = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        if self._read(worker, 120.0) != b"ready\n":  # importing sympy is not the request's time
            worker.kill()
            raise OSError("the sympy worker did not start")
        return worker

    @staticmethod
    def _read(worker: subprocess.Popen, timeout: float) -> bytes | None:
        ready, _, _ = select.select([worker.stdout], [], [], timeout)
        line = worker.stdout.readline() if ready else b""
        return line or None


_SYMPY = _SympyPool(size=max(1, min(4, os.cpu_count() or 1)))


def _serve(memory_bytes: int) -> None:
    """A sympy worker's loop (``_SympyPool``): one JSON request a line, ``true``/``false`` back."""
    import resource

    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    names = {c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    names.update(e=sympy.E, i=sympy.I, pi=sympy.pi, oo=sympy.oo, sqrt=sympy.sqrt, sin=sympy.sin, cos=sympy.cos,
                 tan=sympy.tan, cot=sympy.cot, sec=sympy.sec, csc=sympy.csc, asin=sympy.asin, acos=sympy.acos,
                 atan=sympy.atan, log=sympy.log, ln=sympy.log, exp=sympy.exp)
    transformations = standard_transformations + (implicit_multiplication_application,)

    def equal(x, y, tolerance) -> bool:
        if isinstance(x, tuple) or isinstance(y, tuple):
            return (isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y)
                    and all(equal(p, q, tolerance) for p, q in zip(x, y)))
        if sympy.simplify(x - y) == 0:
            return True
        if x.free_symbols or y.free_symbols:
            return False
        p, q = complex(sympy.N(x)), complex(sympy.N(y))
        return abs(p - q) <= tolerance * max(abs(p), abs(q))

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            x, y = (parse_expr(request[k], local_dict=dict(names), transformations=transformations) for k in "ab")
            same = bool(equal(x, y, request["tolerance"]))
        except Exception:  # an answer sympy cannot read or compare is not equal
            same = False
        print("true" if same else "false", flush=True)

