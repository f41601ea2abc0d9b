"""ML-infrastructure optimisation: make a slow but correct data or training script faster.

Each task ships a correct, deliberately slow pure-Python script (quadratic vocabulary
counting, per-row recomputation of column statistics while standardising features,
list-membership de-duplication of training examples). The verifier, written from the
spec: (1) writes *fresh* input of the same shape (from a seed the agent never saw, so a
cached answer cannot pass), (2) runs the pristine original (kept in /tests) and the
agent's script on it, (3) requires byte-identical output and a CPU-time speedup of at
least the task's threshold (2x at difficulty 1 up to 5x at 5; the oracle reaches
~10x). CPU time, not wall time, so a loaded machine does not fail a good solution.
The oracle writes a helper module first and rewires the script second, so the cut
between them is an unfinished run; the partial solution is fast but changes the output.
"""

from __future__ import annotations

import random

from envs.families.pattern import Pattern, Spec, python_tests

_THRESHOLD = {1: 2.0, 2: 3.0, 3: 3.0, 4: 4.0, 5: 5.0}

_GENERATORS = {
    "vocab": ("data/corpus.txt", '''
def generate(seed):
    import random
    rng = random.Random(seed)
    vocab = ["w%03d" % i for i in range(300)]
    return "".join(" ".join(rng.choice(vocab) for _ in range(20)) + "\\n" for _ in range(2000))
'''),
    "standardize": ("data/features.csv", '''
def generate(seed):
    import random
    rng = random.Random(seed)
    return "".join(",".join(repr(round(rng.gauss(3.0, 2.0), 3)) for _ in range(6)) + "\\n" for _ in range(600))
'''),
    "dedupe": ("data/examples.txt", '''
def generate(seed):
    import random
    rng = random.Random(seed)
    pool = ["example-%05d-%s" % (i, "x" * (i % 7)) for i in range(7000)]
    return "".join(rng.choice(pool) + "\\n" for _ in range(15000))
'''),
}

_SLOW = {
    "vocab": ("build_vocab.py", '''"""Word counts of /app/data/corpus.txt: `word<TAB>count`, most frequent first, ties by word."""
import sys


def main(out_path):
    with open("/app/data/corpus.txt") as f:
        words = f.read().split()
    unique = []
    for w in words:
        if w not in unique:
            unique.append(w)
    counts = []
    for u in unique:
        n = 0
        for w in words:
            if w == u:
                n += 1
        counts.append((u, n))
    counts.sort(key=lambda item: (-item[1], item[0]))
    with open(out_path, "w") as f:
        for word, n in counts:
            f.write(f"{word}\\t{n}\\n")


if __name__ == "__main__":
    main(sys.argv[1])
'''),
    "standardize": ("standardize.py", '''"""Standardise the columns of /app/data/features.csv (z-scores, population std)."""
import sys


def main(out_path):
    with open("/app/data/features.csv") as f:
        rows = [[float(x) for x in line.split(",")] for line in f if line.strip()]
    result = []
    for row in rows:
        new = []
        for j, value in enumerate(row):
            column = [r[j] for r in rows]
            mean = sum(column) / len(column)
            var = sum((c - mean) ** 2 for c in column) / len(column)
            new.append((value - mean) / var ** 0.5)
        result.append(new)
    with open(out_path, "w") as f:
        for row in result:
            f.write(",".join(repr(v) for v in row) + "\\n")


if __name__ == "__main__":
    main(sys.argv[1])
'''),
    "dedupe": ("dedupe.py", '''"""The examples of /app/data/examples.txt without repeats, first occurrence kept."""
import sys


def main(out_path):
    with open("/app/data/examples.txt") as f:
        lines = f.read().splitlines()
    seen = []
    kept = []
    for line in lines:
        if line not in seen:
            seen.append(line)
            kept.append(line)
    with open(out_path, "w") as f:
        f.write("\\n".join(kept) + "\\n")


if __name__ == "__main__":
    main(sys.argv[1])
'''),
}

# kind: (the helper module the oracle writes, the script's body rewired to use it,
#        a fast body whose output differs: the partial solution)
_FAST = {
    "vocab": ('''import collections


def counts(words):
    return sorted(collections.Counter(words).items(), key=lambda item: (-item[1], item[0]))
''', """    from fast_impl import counts
    counts = counts(words)
""", """    import collections
    counts = collections.Counter(words).most_common()
"""),
    "standardize": ('''def standardize(rows):
    stats = []
    for j in range(len(rows[0])):
        column = [r[j] for r in rows]
        mean = sum(column) / len(column)
        var = sum((c - mean) ** 2 for c in column) / len(column)
        stats.append((mean, var ** 0.5))
    return [[(v - stats[j][0]) / stats[j][1] for j, v in enumerate(row)] for row in rows]
''', """    from fast_impl import standardize
    result = standardize(rows)
""", """    import statistics
    stats = [(statistics.mean(c), statistics.stdev(c)) for c in zip(*rows)]
    result = [[(v - stats[j][0]) / stats[j][1] for j, v in enumerate(row)] for row in rows]
"""),
    "dedupe": ('''def dedupe(lines):
    seen = set()
    kept = []
    for line in lines:
        if line not in seen:
            seen.add(line)
            kept.append(line)
    return kept
''', """    from fast_impl import dedupe
    kept = dedupe(lines)
""", """    kept = sorted(set(lines))
"""),
}

_BODY_START = {"vocab": "    unique = []", "standardize": "    result = []", "dedupe": "    seen = []"}
_BODY_END = "    with open(out_path"


def _rewire(kind: str, replacement: str) -> str:
    script = _SLOW[kind][1]
    start, end = script.index(_BODY_START[kind]), script.index(_BODY_END)
    return script[:start] + replacement + script[end:]


def instantiate(rng: random.Random, d: int) -> Spec:
    kind = rng.choice(sorted(_SLOW))
    data_path, generator = _GENERATORS[kind]
    seed, fresh_seed = rng.randrange(1 << 30), rng.randrange(1 << 30)
    space = {}
    exec(generator, space)  # our own generator source, also embedded in the tests
    data = space["generate"](seed)
    script, threshold = _SLOW[kind][0], _THRESHOLD[d]
    text = (f"/app/{script} (run as `python3 /app/{script} OUT`) is correct but slow. Make it at least "
            f"{threshold:g}x faster in CPU time, without changing what it writes for any input of this shape "
            f"(the check runs it on fresh input like /app/{data_path}). Keep the command line the same.\n")
    facts = {"kind": kind, "script": f"/app/{script}", "data": f"/app/{data_path}", "threshold": threshold,
             "fresh_seed": fresh_seed, "generator": generator, "original": _SLOW[kind][1]}
    return Spec(f"ml_{kind}", text, {script: _SLOW[kind][1], data_path: data}, facts, d)


def solve(spec: Spec) -> str:
    kind, script = spec.facts["kind"], spec.facts["script"]
    helper, use, _ = _FAST[kind]
    return (f"#!/bin/bash\ncat > /app/fast_impl.py <<'PY'\n{helper}PY\n"
            f"cat > {script} <<'PY'\n{_rewire(kind, use)}PY\n")


def partials(spec: Spec) -> list[str]:
    kind, script = spec.facts["kind"], spec.facts["script"]
    return [f"#!/bin/bash\ncat > {script} <<'PY'\n{_rewire(kind, _FAST[kind][2])}PY\n"]


def verify(spec: Spec) -> dict[str, str]:
    facts = {k: spec.facts[k] for k in ("script", "data", "threshold", "fresh_seed", "generator")}
    tests = python_tests(facts, """
import resource, subprocess
exec(FACTS["generator"])
with open(FACTS["data"], "w") as f:
    f.write(generate(FACTS["fresh_seed"]))  # fresh input: a cached answer cannot pass

def cpu_seconds(script, out):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, script, out], capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, "%s failed: %s" % (script, proc.stderr[-500:])
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

original = cpu_seconds("/tests/original.py", "/tmp/original.out")
new = cpu_seconds(FACTS["script"], "/tmp/new.out")
same = open("/tmp/new.out", "rb").read() == open("/tmp/original.out", "rb").read()
if same and FACTS["threshold"] / 2 <= original / max(new, 1e-3) < FACTS["threshold"]:
    new = min(new, cpu_seconds(FACTS["script"], "/tmp/new.out"))  # one retry against noise
speedup = original / max(new, 1e-3)
json.dump({"original_cpu": original, "new_cpu": new, "speedup": speedup, "same_output": same},
          open("/logs/verifier/metrics.json", "w"))
assert same, "the output changed"
assert speedup >= FACTS["threshold"], "speedup %.2f is below %s" % (speedup, FACTS["threshold"])
""")
    tests["original.py"] = spec.facts["original"]
    return tests


PATTERNS = [Pattern("ml_infra", "ml_infra", "ml_infra", "speed up a slow data or training script, same output",
                    instantiate, solve, verify, partials, agent_timeout=120.0, verifier_timeout=60.0)]
