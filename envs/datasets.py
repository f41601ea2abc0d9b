"""Prompt datasets as JSONL: one task a line, each with its verifier (``envs/verifiers/``).

    tasks = load_tasks("data/gsm.jsonl")            # or a directory: its *.jsonl files, sorted
    train, heldout = split(tasks, heldout_fraction=0.1, seed=0)
    task.prompt, task.messages, task.oracle(), task.verify(completion), task.difficulty, task.metadata

The RL job reads them with ``task.data=FILE.jsonl`` (or a directory). A row of our schema:

    {"id": "gsm-17",               optional; default <file stem>-<line>. Characters outside
                                   [A-Za-z0-9._-] become "-"; ids are unique across the files
     "prompt": "What is 12*7?",    or "messages": [{"role": "system"|"user"|"assistant",
                                   "content": "..."}, ...] ending with a user turn (the prompt);
                                   a list ending with an assistant turn and no "answer" takes
                                   that turn as the answer (the OpenAI / HF chat format)
     "answer": "84",               the reference answer, also the supervised demonstration
                                   (task.oracle()); a number is read as its text. Optional for
                                   kind python (the reference solution, if given)
     "verifier": "number",         exact | number | math | regex | python (default exact), or
                                   {"kind": "number", "tolerance": 1e-6}: options per kind in
                                   envs/verifiers/
     "tests": "assert add(2, 3) == 5",  kind python only: test code (or a list of lines) run
                                   against the completion's code in a sandbox
     "split": "train"|"heldout",   optional; otherwise by a stable hash (split())
     "difficulty": 1..5,           optional, default 1
     "metadata": {...}}            optional, kept; task.metadata adds "family" ("data:<stem>",
                                   for per-domain metrics), "verifier" (the kind), "location"
                                   ("file:line") and, for a published format, "format"

Published formats are read as they come (``FORMATS``; their own keys, plus any of ``id``,
``verifier``, ``split``, ``difficulty``, ``metadata``):

    gsm8k      {"question", "answer": "... #### 72"}                 -> kind number
    math       {"problem", "solution": "... \\boxed{..}", "level": "Level 3", "type"}
                                                                    -> kind math, difficulty 3
    mbpp       {"task_id", "text" | "prompt", "code", "test_list", "test_setup_code",
                "test_imports", "challenge_test_list"}              -> kind python; the prompt
                                                                       shows the tests, as MBPP's does
    humaneval  {"task_id", "prompt", "canonical_solution", "test", "entry_point"}
                                                                    -> kind python; check(entry_point)

A dataset task is a ``TextTask``: the completion is the model's whole answer (a trailing
terminator is dropped; no cut at the first newline), ``oracle()`` is the answer with the
terminator ("\\n") after it. ``has_oracle`` is False for a python row without a reference
solution and a regex row whose answer is the pattern: their oracle is no demonstration.

Errors: a bad row is a ``ValueError`` that names the file, the line and the field
(``data/x.jsonl:17: field "verifier": unknown kind "numbr"; expected one of exact, math,
number, python, regex``): invalid JSON, not an object, unknown keys, neither or both of
prompt and messages, bad roles or order of messages, a missing answer the kind needs, a
bad regular expression, tests that do not parse, a duplicate id; an empty file or a
directory without ``*.jsonl`` files is one too. Nothing is skipped silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Callable, Mapping

from envs import verifiers
from envs.base import TextTask
from envs.verifiers import FieldError

FIELDS = ("id", "prompt", "messages", "answer", "verifier", "tests", "split", "difficulty", "metadata")
SHARED = ("id", "verifier", "split", "difficulty", "metadata")  # accepted beside a published format's keys
ROLES = ("system", "user", "assistant")
SPLITS = ("train", "heldout")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetTask(TextTask):
    """A row of a JSONL dataset. ``context``: the turns before the prompt; ``split``: the
    row's own, or None (``split()`` decides)."""

    context: tuple[Mapping[str, str], ...] = ()
    split: str | None = None
    has_oracle: bool = True

    @property
    def messages(self) -> list[dict[str, str]]:
        """The whole conversation, ending with the prompt as the user's turn."""
        return [dict(m) for m in self.context] + [{"role": "user", "content": self.instruction}]

    def extract(self, completion: str) -> str:
        return completion.removesuffix(self.terminator)


# ----- published formats -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Format:
    """A published row layout: the keys that identify it, the others it may have, and how
    a row becomes one of our schema."""

    keys: frozenset[str]
    optional: frozenset[str]
    convert: Callable[[dict], dict]


def _text(row: dict, key: str) -> str:
    if not isinstance(row[key], str):
        raise FieldError(key, f"expected a string, got {type(row[key]).__name__}")
    return row[key]


def _gsm8k(row: dict) -> dict:
    return {"prompt": _text(row, "question"), "answer": row["answer"], "verifier": "number"}


def _math(row: dict) -> dict:
    level = re.fullmatch(r"(?:Level )?([1-5])", str(row.get("level", "")))
    meta = {k: row[k] for k in ("type", "subject", "level") if k in row}
    return {"id": row.get("unique_id"), "prompt": _text(row, "problem"), "answer": _text(row, "solution"),
            "verifier": "math",
            "difficulty": int(level.group(1)) if level else 1, "metadata": meta}


def _mbpp(row: dict) -> dict:
    tests = _lines(row["test_list"], "test_list")
    setup = "\n".join(_lines(row.get("test_imports", []), "test_imports") + [row.get("test_setup_code") or ""])
    if "text" not in row and "prompt" not in row:
        raise FieldError("text", 'an MBPP row needs the task as "text" or "prompt"')
    text = _text(row, "text" if "text" in row else "prompt")
    shown = "\n".join(tests)
    return {"id": f"mbpp-{row['task_id']}", "prompt": f"{text}\nYour code should pass these tests:\n\n{shown}",
            "answer": _text(row, "code"), "verifier": "python", "tests": setup.strip() + "\n" + "\n".join(tests) + "\n"}


def _humaneval(row: dict) -> dict:
    if not isinstance(row["entry_point"], str) or not row["entry_point"].isidentifier():
        raise FieldError("entry_point", f"expected a function name, got {row['entry_point']!r}")
    prompt = _text(row, "prompt")
    return {"id": row["task_id"], "prompt": prompt, "answer": prompt + _text(row, "canonical_solution"),
            "verifier": "python", "tests": f"{_text(row, 'test')}\n\ncheck({row['entry_point']})\n"}


FORMATS: dict[str, Format] = {
    "gsm8k": Format(frozenset({"question", "answer"}), frozenset(), _gsm8k),
    "math": Format(frozenset({"problem", "solution"}), frozenset({"level", "type", "subject", "unique_id", "answer"}),
                   _math),
    "mbpp": Format(frozenset({"task_id", "code", "test_list"}),
                   frozenset({"text", "prompt", "test_setup_code", "test_imports", "challenge_test_list",
                              "source_file"}), _mbpp),
    "humaneval": Format(frozenset({"task_id", "prompt", "canonical_solution", "test", "entry_point"}), frozenset(),
                        _humaneval),
}


def _format_of(row: dict) -> str | None:
    """The published format of a row (None: ours); a row that fits none names its unknown keys."""
    keys = set(row)
    if keys <= set(FIELDS):
        return None
    for name, fmt in FORMATS.items():
        if fmt.keys <= keys <= fmt.keys | fmt.optional | set(SHARED):
            return name
    unknown = ", ".join(f'"{k}"' for k in sorted(keys - set(FIELDS)))
    formats = "; ".join(f"{n} ({', '.join(sorted(f.keys))})" for n, f in FORMATS.items())
    raise FieldError(unknown.split(", ")[0].strip('"'),
                     f"unknown key{'s' if ',' in unknown else ''} {unknown}; expected the keys "
                     f"{', '.join(FIELDS)}, or a published format: {formats}")


# ----- rows --------------------------------------------------------------------------------------
def _lines(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FieldError(field, f"expected a list of strings, got {type(value).__name__}")
    return value


def _name(text: str) -> str:
    """``text`` as a Task.id: runs of other characters become "-"; leading ones and trailing dashes go."""
    return re.sub(r"^[^A-Za-z0-9]+", "", re.sub(r"[^A-Za-z0-9._-]+", "-", text)).rstrip("-")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise FieldError("messages", f"expected a non-empty list of {{role, content}} objects, got {value!r:.80}")
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            keys = ", ".join(map(str, m)) if isinstance(m, dict) else type(m).__name__
            raise FieldError("messages", f"message {i} must have exactly the keys role, content; got {keys}")
        if m["role"] not in ROLES:
            raise FieldError("messages", f"message {i} has role {json.dumps(m['role'])}; "
                             f"expected one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise FieldError("messages", f"message {i}: content must be a string, got {type(m['content']).__name__}")
    return value


def _row_task(row: Any, stem: str, lineno: int, location: str, source: str) -> DatasetTask:
    if not isinstance(row, dict):
        raise FieldError("(row)", f"expected a JSON object, got {type(row).__name__}")
    if not isinstance(row.get("metadata", {}), dict):
        raise FieldError("metadata", f"expected an object, got {type(row['metadata']).__name__}")
    fmt = _format_of(row)
    if fmt is not None:
        ours = {k: v for k, v in FORMATS[fmt].convert(row).items() if v is not None}
        row = {**ours, **{k: row[k] for k in SHARED if k in row},
               "metadata": {**ours.get("metadata", {}), **row.get("metadata", {}), "format": fmt}}
    if ("prompt" in row) == ("messages" in row):
        raise FieldError("prompt", 'a row needs "prompt" or "messages"' if "prompt" not in row
                         else 'a row has "prompt" or "messages", not both')
    answer = row.get("answer")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise FieldError("prompt", f"expected a non-empty string, got {row['prompt']!r:.80}")
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        messages = _messages(row["messages"])
        if messages[-1]["role"] == "assistant" and answer is None:
            answer, messages = messages[-1]["content"], messages[:-1]
        if not messages or messages[-1]["role"] != "user":
            found = f"the {messages[-1]['role']}'s" if messages else "no message before the answer"
            raise FieldError("messages", f"the last message must be the user's (the prompt); found {found}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if answer is not None and not isinstance(answer, str):
        raise FieldError("answer", f"expected a string, got {type(answer).__name__}")
    tests = row.get("tests")
    if isinstance(tests, list):
        tests = "\n".join(_lines(tests, "tests")) + "\n"
    elif tests is not None and not isinstance(tests, str):
        raise FieldError("tests", f"expected a string or a list of strings, got {type(tests).__name__}")
    spec = row.get("verifier", "exact")
    verifier = verifiers.make(spec, answer, tests, source)
    kind = spec if isinstance(spec, str) else spec["kind"]
    difficulty = row.get("difficulty", 1)
    if type(difficulty) is not int or not 1 <= difficulty <= 5:
        raise FieldError("difficulty", f"expected an integer in 1..5, got {difficulty!r}")
    split = row.get("split")
    if split is not None and split not in SPLITS:
        raise FieldError("split", f"expected one of {', '.join(SPLITS)}, got {split!r}")
    metadata = row.get("metadata", {})
    raw_id = row.get("id", f"{stem}-{lineno}")
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool) or not _name(str(raw_id)):
        raise FieldError("id", f"expected a name with a letter or digit, got {raw_id!r}")
    return DatasetTask(
        id=_name(str(raw_id)), instruction=messages[-1]["content"], domain="code" if kind == "python" else "reasoning",
        difficulty=difficulty, answer=(answer or "") + "\n", verifier=verifier, context=tuple(messages[:-1]),
        split=split, has_oracle=verifier.demonstrable,
        metadata={**metadata, "family": f"data:{stem}", "verifier": kind, "location": location})


# ----- files ---------------------------------------------------------------------------------------
def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(".jsonl") and os.path.isfile(os.path.join(path, f)))
        if not files:
            raise ValueError(f"{path}: no *.jsonl files in this directory")
        return files
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such dataset file or directory")
    return [path]


def _load_file(path: str, seen: dict[str, str]) -> list[DatasetTask]:
    stem = _name(os.path.splitext(os.path.basename(path))[0]) or "data"
    source = os.path.dirname(os.path.abspath(path))
    tasks = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            try:
                task = _row_task(json.loads(line), stem, lineno, where, source)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
            except FieldError as err:
                raise ValueError(f"{where}: {err}") from None
            if task.id in seen:
                raise ValueError(f'{where}: field "id": duplicate id "{task.id}" (first at {seen[task.id]})')
            seen[task.id] = where
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path}: no rows (the file is empty)")
    return tasks


def load_tasks(path: str) -> list[DatasetTask]:
    """The tasks of a JSONL file, or of every ``*.jsonl`` in a directory (sorted, not recursive)."""
    seen: dict[str, str] = {}
    return [task for file in _files(path) for task in _load_file(file, seen)]


def split(tasks: list[DatasetTask], heldout_fraction: float, seed: int = 0) -> tuple[list, list]:
    """(train, heldout): a row with ``split`` goes where it says; the others are held out
    when a hash of ``seed`` and their id falls below ``heldout_fraction`` (stable across
    runs, machines and the order of the rows)."""
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    train, heldout = [], []
    for task in tasks:
        where = task.split
        if where is None:
            digest = hashlib.sha256(f"{seed}:{task.id}".encode()).digest()
            where = "heldout" if int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction else "train"
        (heldout if where == "heldout" else train).append(task)
    return train, heldout
