"""The kinds ``exact``, ``number`` and ``regex``, and reading a text's final answer and its number
(see ``envs/verifiers/__init__.py``)."""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction
from typing import ClassVar

from envs.base import FULL_REWARD
from envs.verifiers.kind import FieldError, _at_least, _Kind, _needs

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
    """The number a text gives as its answer (``number`` in the package docstring), or None."""
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


# ----- the kinds: exact, number, regex ----------------------------------------------------------
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

