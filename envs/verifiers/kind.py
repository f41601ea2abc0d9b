"""What every verifier kind shares: the error for a wrong row field, the base class, option range checks."""

from __future__ import annotations

from typing import ClassVar, Mapping


class FieldError(ValueError):
    """A row's field is wrong; ``envs/datasets.py`` adds the file and line."""

    def __init__(self, field: str, message: str):
        super().__init__(f'field "{field}": {message}')
        self.field = field


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
