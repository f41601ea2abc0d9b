"""Procedural text tasks for RL with a tiny byte-level model: short prompt, short exact answer.

    family      prompt                    answer        difficulty d (1..5) grows
    arithmetic  "12+7="                   "19\\n"        digits per operand = d; d>=2 adds
                                                        "-", d>=3 adds "*"
    sorting     "sort 3 1 2="             "1 2 3\\n"     list length d+2; values < 10, then < 100
    strings     "rev abc="                "cba\\n"       word length 2+d; ops composed for d>=3
    program     "f(1)=3 f(2)=5 f(3)=7 f=" "2*x+1\\n"     degree and coefficient size
    counting    "count 13 to 21 by 2="    "13 15 17 19   terms = 3 + 2d (steps 1 or 2), so answers
                                          21\\n"        outgrow a short context (for compaction)

All answers end at ``"\\n"``. ``arithmetic``, ``sorting`` and ``strings`` are verified by
exact match; ``program`` answers are expressions in ``x`` (digits, ``x``, ``+ - *``,
parentheses; at most 48 characters) verified by evaluating them at the shown points and
at hidden ones (``ExpressionAnswer``), so any equivalent expression is correct.
``partials``: half-done answers the unfinished check must score 0 (half-sorted lists, one
op of a composition applied). Every ``make(rng, difficulty, index)`` is a pure function
of the rng state.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import random
import string

from envs.base import FULL_REWARD, ExactAnswer, TextTask

_HIDDEN_POINTS = tuple(range(-4, 12))


@dataclasses.dataclass(frozen=True)
class ExpressionAnswer:
    """Full reward when the expression in ``x`` equals ``coefficients`` (a polynomial,
    lowest power first) at every point of ``points``; anything unparsable scores 0."""

    coefficients: tuple[int, ...]
    points: tuple[int, ...] = _HIDDEN_POINTS
    max_chars: int = 48

    def __call__(self, answer: str) -> float:
        if not answer or len(answer) > self.max_chars or answer != answer.strip():
            return 0.0
        try:
            tree = ast.parse(answer, mode="eval")
        except SyntaxError:
            return 0.0
        for x in self.points:
            value = _evaluate(tree.body, x)
            if value is None or value != sum(c * x**i for i, c in enumerate(self.coefficients)):
                return 0.0
        return FULL_REWARD


def _evaluate(node, x: int):
    """Integer value of an expression over x, + - * and parentheses; None if outside that."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name) and node.id == "x":
        return x
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, x)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _evaluate(node.left, x), _evaluate(node.right, x)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Add):
            return left + right
        return left - right if isinstance(node.op, ast.Sub) else left * right
    return None


def _text(family: str, index: int, prompt: str, answer: str, d: int, verifier=None, partials=(), **meta) -> TextTask:
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:10]
    return TextTask(id=f"{family}-d{d}-{digest}", instruction=prompt, domain="reasoning", difficulty=d,
                    answer=answer + "\n", verifier=verifier or ExactAnswer(answer),
                    partials=tuple(p for p in partials if p != answer), metadata={"family": family, **meta})


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def arithmetic(rng: random.Random, d: int, index: int) -> TextTask:
    op = rng.choice("+" if d == 1 else "+-" if d == 2 else "+-*")
    a, b = _number(rng, d), _number(rng, d if op != "*" else max(1, d - 1))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return _text("arithmetic", index, f"{a}{op}{b}=", str(value), d, facts=[a, op, b])


def sorting(rng: random.Random, d: int, index: int) -> TextTask:
    values = [rng.randint(0, 9 if d <= 2 else 99) for _ in range(d + 2)]
    answer = " ".join(map(str, sorted(values)))
    half = len(values) // 2
    partial = " ".join(map(str, sorted(values[:half]) + values[half:]))
    return _text("sorting", index, "sort " + " ".join(map(str, values)) + "=", answer, d, partials=[partial],
                 facts=values)


_OPS = {
    "rev": lambda s: s[::-1],
    "upper": str.upper,
    "rot1": lambda s: "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in s),
    "dup": lambda s: "".join(c + c for c in s),
    "sorted": lambda s: "".join(sorted(s)),
}


def strings(rng: random.Random, d: int, index: int) -> TextTask:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(2 + d))
    names = [rng.choice(sorted(_OPS)) for _ in range(1 if d < 3 else 2)]
    value, steps = word, []
    for name in names:
        value = _OPS[name](value)
        steps.append(value)
    partials = steps[:-1] + [_OPS[names[-1]](word)] if len(names) > 1 else []
    return _text("strings", index, f"{'+'.join(names)} {word}=", value, d, partials=partials, ops=names)


def _poly(coefficients: list[int]) -> str:
    terms = []
    for power in range(len(coefficients) - 1, -1, -1):
        c = coefficients[power]
        if c == 0:
            continue
        body = {0: "", 1: "x"}.get(power, "*".join("x" * power))
        if power == 0:
            text = str(abs(c))
        else:
            text = body if abs(c) == 1 else f"{abs(c)}*{body}"
        terms.append(("-" if c < 0 else "+") + text)
    if not terms:
        return "0"
    first = terms[0]
    return (first[1:] if first[0] == "+" else first) + "".join(terms[1:])


def program(rng: random.Random, d: int, index: int) -> TextTask:
    degree = 1 if d <= 3 else 2
    span = {1: 3, 2: 5, 3: 9, 4: 4, 5: 9}[d]
    coefficients = [rng.randint(-span if d >= 3 else 0, span) for _ in range(degree + 1)]
    coefficients[degree] = coefficients[degree] or 1
    if d == 1:
        coefficients[1] = 1
    shown = sorted(rng.sample(range(0, 6), degree + 2))
    values = [sum(c * x**i for i, c in enumerate(coefficients)) for x in shown]
    prompt = " ".join(f"f({x})={v}" for x, v in zip(shown, values)) + " f="
    return _text("program", index, prompt, _poly(coefficients), d, verifier=ExpressionAnswer(tuple(coefficients)),
                 coefficients=coefficients, shown=shown)


def counting(rng: random.Random, d: int, index: int) -> TextTask:
    """An arithmetic progression written out: long answers whose state is one number (the
    last term), so a summary of a half-written answer is that term (`compaction`)."""
    step, terms = rng.randint(1, 2), 3 + 2 * d
    start = rng.randint(10, 99 - step * (terms - 1))
    values = [start + step * i for i in range(terms)]
    answer = " ".join(map(str, values))
    partial = " ".join(map(str, values[:terms // 2]))
    return _text("counting", index, f"count {start} to {values[-1]} by {step}=", answer, d, partials=[partial],
                 facts=values)


FAMILIES = {"arithmetic": arithmetic, "sorting": sorting, "strings": strings, "program": program,
            "counting": counting}
