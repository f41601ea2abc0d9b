"""Verifier kinds for prompt datasets (``envs/datasets.py``): a completion's text in, 0.0 or 1.0 out.

    verifier = make("number", answer="#### 1,234", tests=None)  # or make({"kind": "number", "tolerance": 1e-3}, ...)
    verifier("... so she pays $1234.")                          # -> 1.0
    KINDS                                                       # kind name -> its class (one line per kind)

Each kind reads the answer out of the completion as its field does, and reads the row's
reference answer the same way, so a GSM8K solution ("... #### 72") is as good a
reference as "72". The options of a kind are the names in its ``OPTIONS``.

    exact   the completion, stripped of surrounding whitespace, equals the stripped
            reference. Options: ignore_case.
    number  the number the completion ends on: the content of the last ``\\boxed{...}``, else
            what follows the last "####" (GSM8K), else what follows the last "answer:" /
            "answer is", else the last number in the text. Thousands commas, a sign,
            decimals, exponents and a plain fraction (``3/4``, ``\\frac{3}{4}``) are read; an
            expression is not evaluated (``\\boxed{12*7}`` is read as 12), so a question
            cannot be answered by restating it. Compared as exact fractions, else with
            ``math.isclose``. Options: tolerance (relative, default 0: a relative 1e-6
            would take 7000001 for 7000000), abs_tolerance (1e-9).
    math    the final answer (``\\boxed{}``, "####", "answer:", else the last non-empty line;
            at most 1000 characters) as an expression: LaTeX-light normalisation (``\\frac \\dfrac \\sqrt \\cdot \\times
            \\left \\right``, ``^``, dollars, degrees, trailing ``\\text{ units}``, ``x = ...``),
            then equal strings, equal exact rationals (``\\frac{1}{2}``, ``0.5``, ``1/2``), or
            ``sympy.simplify(a - b) == 0`` (with a numeric comparison for two numbers) in a
            worker process with a time limit and a memory cap, so a hostile expression
            (``9^9^9^9``) costs ``timeout`` seconds and a worker restart, not the job. Only
            digits, operators, parentheses, commas and known names reach sympy's parser
            (other words are split into one-letter symbols; ``e`` and ``i`` are the
            constants). A form that does not parse (intervals, sets, text) must match as
            a string. Equivalence is symbolic: for "compute 12*7" prefer ``number``, which
            does not accept the unevaluated question. Options: tolerance (1e-9), timeout (5 s).
    regex   the stripped completion fully matches the pattern: the ``pattern`` option (the
            row's answer is then a demonstration that must match it) or the answer itself.
            Options: pattern, ignore_case. The pattern is the dataset author's; one with
            nested quantifiers can backtrack for long on a hostile completion.
    python  the completion's code (the last ```python fenced block, else the whole text)
            and the row's tests run in a fresh ``Sandbox`` (no network, own uid, wall clock,
            memory, processes and output capped); full reward when the harness exits 0.
            Options: timeout (10 s), memory_mb (1024).

The python harness, and what an RL policy could try against it:
- An early clean exit (``os._exit(0)``, ``sys.exit(0)``, ``exec`` of ``/bin/true``, a
  killed test process) is not a pass. The tests run in a child process; the harness (the
  child's parent, PID 1 of the sandbox, not ptrace-able) writes a random nonce into a pipe
  that the child reads only after the last test statement, through a file descriptor
  placed at a random number, and echoes back through another; the verdict is 0 only
  for a child that exited 0 and echoed the nonce.
- Output is ignored: printing "OK" or "passed" does nothing. No file is read back, so
  writing one (``/logs/verifier/reward.txt``) does nothing.
- The tests never touch the disk: they reach the harness on its stdin, which is read
  and closed before the solution runs; the dataset's own directory is hidden from the
  sandbox. A solution that opens the test or data file finds nothing.
- The tests see the builtins as they were before the solution ran (patching
  ``builtins.sorted`` or ``builtins.exec`` changes nothing for them).
- ``assert x == y`` and ``assert x != y`` compare through a check that refuses an
  always-equal object: when one side holds only values of types whose equality is the
  interpreter's (ints, strings, lists ..., and standard ones such as ``Counter``) and the
  other holds a value whose ``__eq__`` / ``__ne__`` is defined by Python code elsewhere
  (a class of the solution, ``unittest.mock.ANY``), the assertion fails.
- Infinite loops end at the wall clock; fork bombs at the process limit; memory hogs at
  the cgroup and address-space caps; output floods at the output cap. Each scores 0.
Not covered: a solution that deliberately tampers with the process it shares with the
tests (reads the expected values out of the calling frame's constants, scans its file
descriptors for the nonce, patches a module the tests import, uses ctypes) can fool an
in-process test. Tests are statements that raise on failure (MBPP / HumanEval asserts);
``unittest.main()`` exits, which counts as a failure.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import re
import select
import shlex
import subprocess
import sys
import threading
from fractions import Fraction
from typing import Any, ClassVar, Mapping

from envs.base import FULL_REWARD
from envs.sandbox.sandbox import Limits, RunResult, Sandbox

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds envs/


class FieldError(ValueError):
    """A row's field is wrong; ``envs/datasets.py`` adds the file and line."""

    def __init__(self, field: str, message: str):
        super().__init__(f'field "{field}": {message}')
        self.field = field


# ----- reading the final answer out of a text ---------------------------------------------------
_HASHES = re.compile(r"####")
_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:|=)", re.IGNORECASE)
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
                     r"|(?:(?<![\w)])-)?\.\d+")
_MAX_NUMBER_CHARS = 400


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":  # "\boxed 5"
        token = re.match(r"[^\s$]+", text[i:])
        return token.group(0) if token else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None  # cut off before its closing brace


def final_answer(text: str) -> str | None:
    """What the text gives as its answer: the last boxed content, else the rest of the line
    after the last "####", else after the last "answer:" / "answer is"; None if none of these."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    for marker in (_HASHES, _ANSWER_IS):
        found = list(marker.finditer(text))
        if found:
            return text[found[-1].end():].split("\n", 1)[0]
    return None


def _number(token: str) -> Fraction | None:
    token = token.replace(",", "")
    exponent = re.search(r"[eE]([-+]?\d+)$", token)
    if len(token) > _MAX_NUMBER_CHARS or (exponent and abs(int(exponent.group(1))) > _MAX_NUMBER_CHARS):
        return None
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


_PLAIN_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_FRACTION = re.compile(rf"\s*({_PLAIN_NUMBER})\s*(?:/\s*({_PLAIN_NUMBER}))?\s*")
_LATEX_FRACTION = re.compile(r"\s*(-?)\s*\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}\s*")


def extract_number(text: str) -> Fraction | None:
    """The number a text gives as its answer (``number`` in the module docstring), or None."""
    segment = final_answer(text)
    if segment is None:
        tokens = _NUMBER.findall(text)
        return _number(tokens[-1]) if tokens else None
    cleaned = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", segment)
    cleaned = re.sub(r"\\?\$|\\?%|\\[,;! ]|\\text\{[^{}]*\}", " ", cleaned).strip().rstrip(".").strip()
    latex = _LATEX_FRACTION.fullmatch(cleaned)
    plain = _FRACTION.fullmatch(cleaned)
    if latex or plain:
        sign, top, bottom = latex.groups() if latex else ("", *plain.groups())
        top, bottom = _number(top), _number(bottom) if bottom else Fraction(1)
        return (-1 if sign else 1) * top / bottom if top is not None and bottom else None
    tokens = _NUMBER.findall(segment)
    return _number(tokens[0]) if tokens else None


def _close(a: Fraction, b: Fraction, rel: float, abs_: float) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=abs_)
    except OverflowError:
        return False


# ----- the kinds --------------------------------------------------------------------------------
class _Kind:
    """What every kind has. ``OPTIONS``: option name -> its type. ``demonstrable``: the row's
    answer is a completion that earns the reward (a supervised demonstration)."""

    OPTIONS: ClassVar[Mapping[str, type]] = {}
    RUNS_TESTS: ClassVar[bool] = False
    demonstrable: bool = True


def _needs(answer: str | None, kind: str) -> str:
    if answer is None:
        raise FieldError("answer", f'kind "{kind}" needs the reference answer')
    return answer


def _at_least(name: str, value: float, low: float) -> None:
    if not value >= low:
        raise ValueError(f"option {name!r} must be >= {low}, got {value!r}")


def _above(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"option {name!r} must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Exact(_Kind):
    expected: str
    ignore_case: bool = False
    OPTIONS: ClassVar = {"ignore_case": bool}

    @classmethod
    def build(cls, answer, tests, source, **options) -> Exact:
        return cls(_needs(answer, "exact").strip(), **options)

    def __call__(self, completion: str) -> float:
        got, want = completion.strip(), self.expected
        if self.ignore_case:
            got, want = got.casefold(), want.casefold()
        return FULL_REWARD if got == want else 0.0


@dataclasses.dataclass(frozen=True)
class Number(_Kind):
    expected: Fraction
    tolerance: float = 0.0
    abs_tolerance: float = 1e-9
    OPTIONS: ClassVar = {"tolerance": float, "abs_tolerance": float}

    def __post_init__(self):
        _at_least("tolerance", self.tolerance, 0.0)
        _at_least("abs_tolerance", self.abs_tolerance, 0.0)

    @classmethod
    def build(cls, answer, tests, source, **options) -> Number:
        value = extract_number(_needs(answer, "number"))
        if value is None:
            raise FieldError("answer", f"no number in {answer[-200:]!r}")
        return cls(value, **options)

    def __call__(self, completion: str) -> float:
        got = extract_number(completion)
        passed = got is not None and _close(got, self.expected, self.tolerance, self.abs_tolerance)
        return FULL_REWARD if passed else 0.0


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


@dataclasses.dataclass(frozen=True)
class Regex(_Kind):
    pattern: str
    ignore_case: bool = False
    demonstrable: bool = True
    OPTIONS: ClassVar = {"pattern": str, "ignore_case": bool}

    @classmethod
    def build(cls, answer, tests, source, pattern=None, ignore_case=False) -> Regex:
        field = "verifier" if pattern is not None else "answer"
        pattern = pattern if pattern is not None else _needs(answer, "regex")
        try:
            compiled = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as err:
            raise FieldError(field, f"bad regular expression {pattern!r}: {err}") from None
        demonstrable = field == "verifier" and answer is not None
        if demonstrable and not compiled.fullmatch(answer.strip()):
            raise FieldError("answer", f"{answer!r} does not match its own pattern {pattern!r}")
        return cls(pattern, ignore_case, demonstrable)

    def __call__(self, completion: str) -> float:
        found = re.fullmatch(self.pattern, completion.strip(), re.IGNORECASE if self.ignore_case else 0)
        return FULL_REWARD if found else 0.0


@dataclasses.dataclass(frozen=True)
class Python(_Kind):
    tests: str
    timeout: float = 10.0
    memory_mb: int = 1024
    demonstrable: bool = True
    hide: tuple[str, ...] = ()  # host directories the sandbox must not show (the dataset's)
    OPTIONS: ClassVar = {"timeout": float, "memory_mb": int}
    RUNS_TESTS: ClassVar = True

    def __post_init__(self):
        _above("timeout", self.timeout)
        _above("memory_mb", self.memory_mb)

    @classmethod
    def build(cls, answer, tests, source, **options) -> Python:
        if not tests:
            raise FieldError("tests", 'kind "python" needs the test code that the completion must pass')
        try:
            ast.parse(tests)
        except SyntaxError as err:
            raise FieldError("tests", f"not valid Python: {err.msg} (line {err.lineno})") from None
        return cls(tests, **options, demonstrable=answer is not None, hide=(source,) if source else ())

    def run(self, completion: str) -> RunResult:
        """The harness's run in a fresh sandbox (its output is for people; the verdict is its status)."""
        limits = Limits(wall_seconds=self.timeout, cpu_seconds=math.ceil(self.timeout) + 1,
                        memory_bytes=self.memory_mb << 20, processes=32, output_bytes=64 << 10)
        payload = json.dumps({"solution": python_code(completion), "tests": self.tests})
        with Sandbox(limits=limits, hide=self.hide) as sandbox:
            return sandbox.run(f"exec python3 -I -c {shlex.quote(_HARNESS)}", stdin=payload)

    def __call__(self, completion: str) -> float:
        result = self.run(completion)
        return FULL_REWARD if result.returncode == 0 and result.killed is None else 0.0


KINDS: dict[str, type[_Kind]] = {"exact": Exact, "math": Math, "number": Number, "python": Python, "regex": Regex}


def make(spec: str | Mapping[str, Any], answer: str | None, tests: str | None, source: str | None = None):
    """The verifier a row asks for: ``spec`` is a kind name or ``{"kind": name, option: value}``;
    ``source``: the dataset's directory (hidden from sandboxes). Raises ``FieldError``."""
    if isinstance(spec, str):
        kind, options = spec, {}
    elif isinstance(spec, Mapping):
        if "kind" not in spec:
            raise FieldError("verifier", f'an object needs "kind"; got the keys {", ".join(map(str, spec))}')
        kind, options = spec["kind"], {k: v for k, v in spec.items() if k != "kind"}
    else:
        raise FieldError("verifier", f"expected a kind name or an object, got {type(spec).__name__}")
    if not isinstance(kind, str) or kind not in KINDS:
        raise FieldError("verifier", f"unknown kind {json.dumps(kind)}; expected one of {', '.join(sorted(KINDS))}")
    cls = KINDS[kind]
    for name, value in options.items():
        if name not in cls.OPTIONS:
            valid = ", ".join(sorted(cls.OPTIONS)) or "none"
            raise FieldError("verifier", f'unknown option "{name}" for kind "{kind}"; expected one of: {valid}')
        want = cls.OPTIONS[name]
        if isinstance(value, bool) != (want is bool) or not isinstance(value, (int, float) if want is float else want):
            raise FieldError("verifier", f'option "{name}" of kind "{kind}" must be a {want.__name__}, got {value!r}')
    if tests is not None and not cls.RUNS_TESTS:
        raise FieldError("tests", f'kind "{kind}" runs no tests; only kind "python" does')
    try:
        return cls.build(answer, tests, source, **options)
    except FieldError:
        raise
    except ValueError as err:  # an option out of its range (the kind's __post_init__)
        raise FieldError("verifier", f'kind "{kind}": {err}') from None


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
    """An answer in light LaTeX as an expression string (see ``math`` in the module docstring)."""
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
                f"from envs.verifiers import _serve; _serve({self.memory_bytes})")
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


# ----- python: the code of a completion, and the harness that tests it --------------------------
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("", "python", "python3", "py")


def python_code(completion: str) -> str:
    """The last ```python (or untagged) fenced block; an unclosed last fence's rest; else the whole text."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion) if m.group(1).lower() in _PYTHON_TAGS]
    if blocks:
        return blocks[-1]
    opened = re.search(r"```[ \t]*(?:python3?|py)?[ \t]*\n", completion)
    return completion[opened.end():] if opened and "```" not in completion[opened.end():] else completion


# Run in the sandbox as `python3 -I -c HARNESS` with {"solution", "tests"} on stdin (see the
# module docstring). Everything the verdict depends on is bound before the solution runs.
_HARNESS = r'''
import ast, builtins, collections, json, os, random, resource, sys, traceback, types

_exit, _read, _write, _run = os._exit, os.read, os.write, exec
HEAP_TYPE = 1 << 9
MRO, DICT, FLAGS = (type.__dict__[k].__get__ for k in ("__mro__", "__dict__", "__flags__"))
CHECK = "__verifier_compare__"


def defining(cls, name):
    for k in MRO(cls):
        if name in DICT(k):
            return k, DICT(k)[name]
    return object, None


TRUSTED = {}  # standard classes whose equality is Python code, as they were before the solution ran
for cls in (collections.Counter,):
    for name in ("__eq__", "__ne__"):
        k, f = defining(cls, name)
        TRUSTED[(k, name)] = f


def trusted_type(t):
    for name in ("__eq__", "__ne__"):
        k, f = defining(t, name)
        if FLAGS(k) & HEAP_TYPE and TRUSTED.get((k, name), TRUSTED) is not f:
            return False
    return True


def honest(value, budget=1_000_000):
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        t = type(v)
        if not trusted_type(t):
            return False
        for base in (dict, list, tuple, set, frozenset):
            if issubclass(t, base) and id(v) not in seen:
                seen.add(id(v))
                stack.extend(list(dict.keys(v)) + list(dict.values(v)) if base is dict else base.__iter__(v))
                break
        if len(seen) > budget:
            return False
    return True


def compare(left, right, equal):
    if honest(left) != honest(right):
        return False
    return bool(left == right) if equal else bool(left != right)


class Rewrite(ast.NodeTransformer):
    def visit_Assert(self, node):
        self.generic_visit(node)
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], (ast.Eq, ast.NotEq)):
            node.test = ast.Call(ast.Name(CHECK, ast.Load()),
                                 [t.left, t.comparators[0], ast.Constant(isinstance(t.ops[0], ast.Eq))], [])
        return node


def child(solution, tests, nonce_fd, done_fd):
    clean = dict(builtins.__dict__)
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        _run(solution, module.__dict__)
        names = {k: v for k, v in module.__dict__.items() if not (k.startswith("__") and k.endswith("__"))}
        names.update({"__builtins__": clean, "__name__": "__tests__", CHECK: compare})
        _run(tests, names)
    except BaseException:  # SystemExit included: an exit before the tests end is a failure
        try:
            sys.stdout.flush()
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            _exit(1)
    _write(done_fd, _read(nonce_fd, 64))
    _exit(0)


def main():
    payload = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    os.close(0)
    try:
        solution = compile(payload["solution"], "solution.py", "exec")
    except (SyntaxError, ValueError) as err:
        print(f"the solution does not compile: {err}", flush=True)
        _exit(1)
    tests = compile(ast.fix_missing_locations(Rewrite().visit(ast.parse(payload["tests"]))), "<tests>", "exec")
    del payload
    try:  # not dumpable: the tests' process cannot ptrace this one or read its memory
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass
    nonce_r, nonce_w = os.pipe()
    done_r, done_w = os.pipe()
    limit = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1024)
    free = [fd for fd in range(10, limit) if fd not in (nonce_r, nonce_w, done_r, done_w)]
    slots = random.SystemRandom().sample(free, 2)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(nonce_w)
            os.close(done_r)
            os.dup2(nonce_r, slots[0])
            os.dup2(done_w, slots[1])
            os.close(nonce_r)
            os.close(done_w)
            child(solution, tests, *slots)
        finally:
            _exit(1)
    os.close(nonce_r)
    os.close(done_w)
    nonce = os.urandom(16).hex().encode()
    os.write(nonce_w, nonce)
    os.close(nonce_w)
    _, status = os.waitpid(pid, 0)
    os.set_blocking(done_r, False)
    try:
        echoed = os.read(done_r, 64)
    except BlockingIOError:
        echoed = b""
    passed = os.waitstatus_to_exitcode(status) == 0 and echoed == nonce
    print("tests passed" if passed else "tests failed", flush=True)
    _exit(0 if passed else 1)


main()
'''
