"""Writing a benchmark's results/*.json: the run's report, with the file's `findings` kept.

A results file holds what a run measured and, under `findings`, what earlier runs
established in words (what was tried and what it gave); a rerun replaces the first and
carries the second over.
"""

from __future__ import annotations

import json
import pathlib


def write(path, report: dict, indent: int = 2) -> None:
    path = pathlib.Path(path)
    if path.exists() and "findings" not in report:
        try:
            earlier = json.loads(path.read_text())
        except ValueError:
            earlier = {}
        if isinstance(earlier, dict) and "findings" in earlier:
            report = {**report, "findings": earlier["findings"]}
    path.write_text(json.dumps(report, indent=indent) + "\n")
