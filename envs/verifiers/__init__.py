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

The python harness and what it defends against: ``envs/verifiers/python_tests.py``.

    kind.py          FieldError and what every kind shares (the base class, option range checks)
    text.py          exact, number, regex; reading the final answer and the number out of a text
    expressions.py   math: LaTeX-light normalisation, exact rationals, sympy in capped workers
    python_tests.py  python: the completion's code and the sandboxed harness that tests it
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from envs.verifiers.expressions import _ROOT as _ROOT  # the folder the math workers import envs/ from
from envs.verifiers.expressions import Math, latex_to_expression, math_answer
from envs.verifiers.kind import FieldError, _Kind
from envs.verifiers.python_tests import Python, python_code
from envs.verifiers.text import Exact, Number, Regex, extract_number, final_answer

__all__ = ["KINDS", "Exact", "FieldError", "Math", "Number", "Python", "Regex", "extract_number", "final_answer",
           "latex_to_expression", "make", "math_answer", "python_code"]

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
