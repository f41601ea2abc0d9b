"""Code repair, SWE-smith style: a Python function with injected bugs and its tests.

A module holds one target function (and, from difficulty 2, a correct neighbour). Bugs
are single-line mutations of the target's AST (comparison flips, arithmetic swaps,
off-by-one constants, and/or swaps), 1 bug at difficulty 1-2, 2 at 3-4, 3 at 5. Which
tests fail is measured, never assumed: one sandboxed run executes every test against the
correct module, the fully bugged one, and each one-bug variant. An instance is kept only
when it has >= 1 fail-to-pass test (fails bugged, passes fixed) and >= 1 pass-to-pass
test (passes both), and every single bug on its own fails some test (so fixing one bug of
two earns nothing). The oracle restores the mutated lines one statement per bug.
"""

from __future__ import annotations

import ast
import json
import random

from envs.families.pattern import Pattern, Spec, python_tests
from envs.sandbox.sandbox import Limits, Sandbox

TEMPLATES = {
    "clamp": ('''def clamp(value, low, high):
    """Return value limited to the closed range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
''', [(5, 0, 10), (-3, 0, 10), (12, 0, 10), (0, 0, 10), (10, 0, 10), (7, 7, 7), (-5, -9, -1)]),
    "count_vowels": ('''def count_vowels(text):
    """Count the vowels (a, e, i, o, u, in either case) in text."""
    total = 0
    for ch in text.lower():
        if ch in "aeiou":
            total += 1
    return total
''', [("hello",), ("",), ("AEIOU",), ("rhythm",), ("Banana Split",), ("queue",)]),
    "running_sum": ('''def running_sum(values):
    """Return the list of prefix sums: running_sum([1, 2, 3]) == [1, 3, 6]."""
    out = []
    total = 0
    for v in values:
        total = total + v
        out.append(total)
    return out
''', [([1, 2, 3],), ([],), ([5],), ([-1, 1, -1],), ([0, 0, 4],), ([10, 20, 30, 40],)]),
    "binary_search": ('''def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1 when it is absent."""
    lo = 0
    hi = len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''', [([1, 3, 5, 7, 9], 7), ([1, 3, 5, 7, 9], 1), ([1, 3, 5, 7, 9], 9), ([1, 3, 5], 4), ([], 2), ([2], 2),
      ([1, 2, 4, 8, 16, 32], 32), ([1, 2, 4, 8, 16, 32], 0)]),
    "is_palindrome": ('''def is_palindrome(text):
    """True when text reads the same backwards, ignoring case and anything but letters."""
    letters = [c.lower() for c in text if c.isalpha()]
    i = 0
    j = len(letters) - 1
    while i < j:
        if letters[i] != letters[j]:
            return False
        i += 1
        j -= 1
    return True
''', [("Racecar",), ("A man, a plan, a canal: Panama",), ("abc",), ("",), ("ab",), ("abca",), ("x",)]),
    "rle": ('''def rle(text):
    """Run-length encode text: rle("aaab") == "a3b1"; rle("") == ""."""
    if not text:
        return ""
    out = []
    current = text[0]
    count = 1
    for ch in text[1:]:
        if ch == current:
            count += 1
        else:
            out.append(current + str(count))
            current = ch
            count = 1
    out.append(current + str(count))
    return "".join(out)
''', [("aaab",), ("",), ("a",), ("abc",), ("zzzzzz",), ("aabbaa",)]),
    "second_largest": ('''def second_largest(values):
    """The second largest distinct value in values, or None when there is none."""
    best = None
    second = None
    for v in values:
        if best is None or v > best:
            if best is not None:
                second = best
            best = v
        elif v != best and (second is None or v > second):
            second = v
    return second
''', [([3, 1, 2],), ([5, 5, 5],), ([],), ([1, 2],), ([9, 7, 9, 8],), ([-1, -5, -3],), ([4],)]),
    "gcd": ('''def gcd(a, b):
    """Greatest common divisor of two non-negative integers; gcd(0, 0) == 0."""
    while b != 0:
        a, b = b, a % b
    return a
''', [(12, 18), (7, 13), (0, 5), (5, 0), (0, 0), (100, 75), (17, 17)]),
    "fizzbuzz": ('''def fizzbuzz(n):
    """"Fizz" for multiples of 3, "Buzz" for multiples of 5, "FizzBuzz" for both, else str(n)."""
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
''', [(1,), (3,), (5,), (15,), (30,), (7,), (9,), (10,)]),
    "merge_sorted": ('''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = 0
    j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
''', [([1, 4, 9], [2, 3, 10]), ([], [1, 2]), ([1, 2], []), ([1, 1], [1]), ([5], [1, 2, 3]), ([0, 2, 4], [1, 3, 5])]),
}

_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
          ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv,
          ast.And: ast.Or, ast.Or: ast.And, ast.In: ast.NotIn}


def _mutations(source: str) -> list[tuple[int, int, int, str]]:
    """Single-line mutations of a function: (line index, start col, end col, new text)."""
    func = ast.parse(source).body[0]
    lines, out = source.splitlines(keepends=True), []
    for node in ast.walk(func):
        if getattr(node, "lineno", None) is None or node.lineno != node.end_lineno or node.lineno <= 2:
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            new = ast.Constant(node.value + (1 if node.value == 0 else -1))
        elif isinstance(node, ast.Compare) and type(node.ops[0]) in _SWAPS:
            new = ast.Compare(node.left, [_SWAPS[type(node.ops[0])]()] + node.ops[1:], node.comparators)
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _SWAPS:
            new = ast.BinOp(node.left, _SWAPS[type(node.op)](), node.right) if isinstance(node, ast.BinOp) \
                else ast.AugAssign(node.target, _SWAPS[type(node.op)](), node.value)
        elif isinstance(node, ast.BoolOp):
            new = ast.BoolOp(_SWAPS[type(node.op)](), node.values)
        else:
            continue
        text = ast.unparse(new)
        before = lines[node.lineno - 1][node.col_offset - 1: node.col_offset]
        if isinstance(node, (ast.BoolOp, ast.BinOp, ast.Compare)) and before != "(":
            text = f"({text})"  # keep the precedence the original expression had
        out.append((node.lineno - 1, node.col_offset, node.end_col_offset, text))
    return out


def _apply(lines: list[str], mutations) -> str:
    lines = list(lines)
    for index, start, end, text in mutations:
        lines[index] = lines[index][:start] + text + lines[index][end:]
    return "".join(lines)


_HARNESS = r'''
import json, signal, sys
def alarm(*_):
    raise TimeoutError
signal.signal(signal.SIGALRM, alarm)
spec = json.load(open(sys.argv[1]))
report = []
for source in spec["variants"]:
    space, row = {}, []
    try:
        exec(compile(source, "mod.py", "exec"), space)
    except Exception:
        report.append([False] * len(spec["cases"]))
        continue
    for fn, args, want in spec["cases"]:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            row.append(space[fn](*args) == want)
        except TimeoutError:
            row.append(None)
        except BaseException:
            row.append(False)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    report.append(row)
print(json.dumps(report))
'''


def _measure(variants: list[str], cases: list) -> list[list[bool]] | None:
    """Pass/fail of every case for every variant, run in a sandbox (mutants may loop)."""
    with Sandbox(limits=Limits(wall_seconds=30.0, cpu_seconds=20, memory_bytes=1 << 30)) as box:
        box.write_file("/app/harness.py", _HARNESS)
        box.write_file("/app/spec.json", json.dumps({"variants": variants, "cases": cases}))
        result = box.run("python3 harness.py spec.json")
    try:
        return json.loads(result.output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _expected(source: str, fn: str, inputs) -> list:
    space = {}
    exec(compile(source, "template", "exec"), space)  # the unmutated templates above: trusted code
    return [[fn, list(args), space[fn](*args)] for args in inputs]


def instantiate(rng: random.Random, d: int) -> Spec | None:
    target = rng.choice(sorted(TEMPLATES))
    source, inputs = TEMPLATES[target]
    n_bugs = 1 if d <= 2 else 2 if d <= 4 else 3
    by_line = {}
    for m in _mutations(source):
        by_line.setdefault(m[0], []).append(m)
    if len(by_line) < n_bugs:
        return None
    chosen = [rng.choice(by_line[line]) for line in sorted(rng.sample(sorted(by_line), n_bugs))]
    lines = source.splitlines(keepends=True)
    buggy = _apply(lines, chosen)
    neighbour = rng.choice(sorted(set(TEMPLATES) - {target})) if d >= 2 else None
    extra = TEMPLATES[neighbour][0] if neighbour else ""
    cases = _expected(source, target, inputs) + (_expected(extra, neighbour, TEMPLATES[neighbour][1]) if neighbour else [])
    module = rng.choice(["utils", "helpers", "core", "mathlib", "textops"])
    variants = [source + "\n\n" + extra, buggy + "\n\n" + extra] + [_apply(lines, [m]) + "\n\n" + extra for m in chosen]
    table = _measure(variants, cases)
    if table is None or not all(table[0]) or any(ok is None for row in table for ok in row):
        return None  # a mutant that hangs makes a slow verifier; draw another
    f2p = [i for i, ok in enumerate(table[1]) if not ok]
    p2p = [i for i, ok in enumerate(table[1]) if ok]
    if not f2p or not p2p or (n_bugs > 1 and not all(not all(row) for row in table[2:])):
        return None
    content = buggy + ("\n\n" + extra if extra else "")
    bugs = "a bug" if n_bugs == 1 else f"{n_bugs} bugs"
    text = (f"The function `{target}` in /app/{module}.py has {bugs}: it does not do what its docstring says. "
            f"Fix `{target}` in place (same name and signature). Hidden tests will import /app/{module}.py.\n")
    fixes = [(i, lines[i]) for i, _, _, _ in chosen]
    return Spec("code_repair", text, {f"{module}.py": content},
                {"module": module, "function": target, "cases": cases,
                 "metadata": {"fail_to_pass": f2p, "pass_to_pass": p2p, "bugs": n_bugs}},
                d, private={"fixes": fixes})


def solve(spec: Spec) -> str:
    path = f"/app/{spec.facts['module']}.py"
    out = ["#!/bin/bash"]
    for index, line in spec.private["fixes"]:
        out += ["python3 - <<'PY'", "import pathlib", f"path = pathlib.Path({path!r})",
                "lines = path.read_text().splitlines(keepends=True)", f"lines[{index}] = {line!r}",
                'path.write_text("".join(lines))', "PY"]
    return "\n".join(out) + "\n"


def partials(spec: Spec) -> list[str]:
    """One-bug tasks have no cut point in their oracle: an edit that touches the file
    without fixing it stands in (it catches verifiers that check only mtime or a diff)."""
    if spec.facts["metadata"]["bugs"] > 1:
        return []
    path = f"/app/{spec.facts['module']}.py"
    note = f"printf '# TODO: fix {spec.facts['function']}\\n'"
    return [f"#!/bin/bash\n{note} | cat - {path} > /app/.edit && mv /app/.edit {path}\n"]


def verify(spec: Spec) -> dict[str, str]:
    return python_tests({"module": spec.facts["module"], "cases": spec.facts["cases"]}, """
import importlib.util, signal
def alarm(*_):
    raise TimeoutError("test case timed out")
signal.signal(signal.SIGALRM, alarm)
path = "/app/%s.py" % FACTS["module"]
loader = importlib.util.spec_from_file_location(FACTS["module"], path)
module = importlib.util.module_from_spec(loader)
loader.loader.exec_module(module)
failed = []
for i, (fn, args, want) in enumerate(FACTS["cases"]):
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        got = getattr(module, fn)(*args)
    except Exception as err:
        got = "raised %r" % err
    signal.setitimer(signal.ITIMER_REAL, 0)
    if got != want:
        failed.append((i, fn, args, want, got))
json.dump({"failed": [f[0] for f in failed]}, open("/logs/verifier/results.json", "w"))
assert not failed, failed
""")


PATTERNS = [Pattern("code_repair", "code_repair", "code", "fix injected bugs in a Python function",
                    instantiate, solve, verify, partials, agent_timeout=60.0, verifier_timeout=30.0)]
