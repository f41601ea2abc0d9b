"""Security: small vulnerable programs with exploit tests (detection and repair).

Five templates: path traversal, shell command injection, SQL injection, ``eval`` of
user input, unpickling untrusted data. The module holds the vulnerable function and a
harmless neighbour; identifiers and data are drawn per task. The tests are functional
(pass before and after the fix: pass-to-pass) plus exploits (succeed against the
vulnerable code: fail-to-pass). Reward 1 only when every exploit is blocked and every
functional test still passes. The instruction asks the model to submit the vulnerable
function's name; ``metadata["vulnerable_function"]`` holds it for the evaluation's
detection sub-metric (the sandbox verifier grades repair only). Partial solution: one
that blocks the exploit by breaking the function.
"""

from __future__ import annotations

import random

from envs.families.pattern import Pattern, Spec, python_tests

_NEIGHBOUR = '''

def slugify(text):
    """Lower-case words joined by dashes."""
    return "-".join(text.lower().split())
'''

# kind: (difficulty, vulnerable source, fixed source, broken-but-safe source, test body); {fn} is the name.
TEMPLATES = {
    "path_traversal": (2, '''import os

BASE = "/app/notes"


def {fn}(name):
    """Text of the note called name, from the notes directory BASE."""
    with open(os.path.join(BASE, name)) as f:
        return f.read()
''', '''import os

BASE = "/app/notes"


def {fn}(name):
    """Text of the note called name, from the notes directory BASE."""
    base = os.path.realpath(BASE)
    path = os.path.realpath(os.path.join(base, name))
    if not path.startswith(base + os.sep):
        raise ValueError("note outside the notes directory")
    with open(path) as f:
        return f.read()
''', '''def {fn}(name):
    raise ValueError("disabled")
''', '''
assert fn("todo.txt") == FACTS["todo"]
assert fn("sub/idea.txt") == "idea\\n"
for attack in ("../secret.txt", "/app/secret.txt", "sub/../../secret.txt"):
    try:
        leaked = fn(attack)
    except Exception:
        leaked = None
    assert leaked != FACTS["secret"], "path traversal still works: %r" % attack
'''),
    "command_injection": (2, '''import subprocess


def {fn}(path):
    """Number of lines in the file at path."""
    out = subprocess.run(f"wc -l < {{path}}", shell=True, capture_output=True, text=True).stdout
    return int(out.strip())
''', '''def {fn}(path):
    """Number of lines in the file at path."""
    with open(path, "rb") as f:
        return f.read().count(b"\\n")
''', '''def {fn}(path):
    return 0
''', '''
assert fn("/app/data.txt") == FACTS["lines"]
marker = FACTS["marker"]
try:
    fn("/app/data.txt; touch " + marker)
except Exception:
    pass
assert not os.path.exists(marker), "command injection still works"
'''),
    "sql_injection": (3, '''import sqlite3


def {fn}(db_path, name):
    """Rows (id, name, email) of the users called name."""
    con = sqlite3.connect(db_path)
    try:
        return con.execute(f"SELECT id, name, email FROM users WHERE name = '{{name}}'").fetchall()
    finally:
        con.close()
''', '''import sqlite3


def {fn}(db_path, name):
    """Rows (id, name, email) of the users called name."""
    con = sqlite3.connect(db_path)
    try:
        return con.execute("SELECT id, name, email FROM users WHERE name = ?", (name,)).fetchall()
    finally:
        con.close()
''', '''def {fn}(db_path, name):
    return []
''', '''
import sqlite3
db = "/tmp/users.db"
con = sqlite3.connect(db)
con.execute("CREATE TABLE users (id INTEGER, name TEXT, email TEXT)")
con.executemany("INSERT INTO users VALUES (?, ?, ?)", [tuple(u) for u in FACTS["users"]])
con.commit()
con.close()
first = FACTS["users"][0]
assert fn(db, first[1]) == [tuple(first)]
assert fn(db, "nobody") == []
try:
    rows = fn(db, "x' OR '1'='1")
except Exception:
    rows = []
assert rows == [], "SQL injection still works"
'''),
    "unsafe_eval": (4, '''def {fn}(expression):
    """Value of an arithmetic expression over numbers with + - * / and parentheses."""
    return eval(expression)
''', '''import ast
import operator

_OPS = {{ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}}


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError("not an arithmetic expression")


def {fn}(expression):
    """Value of an arithmetic expression over numbers with + - * / and parentheses."""
    return _value(ast.parse(expression, mode="eval").body)
''', '''def {fn}(expression):
    raise ValueError("disabled")
''', '''
for text, want in FACTS["cases"]:
    assert fn(text) == want, (text, fn(text), want)
marker = FACTS["marker"]
try:
    fn("__import__('os').system('touch %s')" % marker)
except Exception:
    pass
assert not os.path.exists(marker), "code injection through eval still works"
'''),
    "unsafe_pickle": (3, '''import base64
import pickle


def {fn}(blob):
    """Settings dict from a base64 string made by dump_settings."""
    return pickle.loads(base64.b64decode(blob))


def dump_settings(settings):
    return base64.b64encode(pickle.dumps(settings)).decode()
''', '''import base64
import json


def {fn}(blob):
    """Settings dict from a base64 string made by dump_settings."""
    return json.loads(base64.b64decode(blob))


def dump_settings(settings):
    return base64.b64encode(json.dumps(settings).encode()).decode()
''', '''def {fn}(blob):
    return {{}}


def dump_settings(settings):
    return ""
''', '''
import base64, pickle
settings = FACTS["settings"]
assert fn(module.dump_settings(settings)) == settings
marker = FACTS["marker"]
class Exploit:
    def __reduce__(self):
        return (os.system, ("touch " + marker,))
try:
    fn(base64.b64encode(pickle.dumps(Exploit())).decode())
except Exception:
    pass
assert not os.path.exists(marker), "unpickling untrusted data still runs code"
'''),
}

_NAMES = {"path_traversal": ["read_note", "load_page", "open_doc"], "command_injection": ["count_lines", "line_total"],
          "sql_injection": ["find_user", "lookup_user"], "unsafe_eval": ["calculate", "evaluate"],
          "unsafe_pickle": ["load_settings", "read_config"]}


def instantiate(rng: random.Random, d: int) -> Spec:
    kinds = [k for k, t in TEMPLATES.items() if t[0] <= max(d, 2)]
    kind = rng.choice(sorted(kinds))
    level, vulnerable, fixed, broken, body = TEMPLATES[kind]
    fn, module = rng.choice(_NAMES[kind]), rng.choice(["service", "handlers", "api", "storage"])
    files = {f"{module}.py": vulnerable.format(fn=fn) + _NEIGHBOUR}
    facts = {"module": module, "function": fn, "kind": kind, "marker": f"/tmp/pwned-{rng.randrange(1 << 30)}",
             "metadata": {"vulnerable_function": fn, "vulnerability": kind}}
    private = {"fixed": fixed.format(fn=fn) + _NEIGHBOUR, "broken": broken.format(fn=fn) + _NEIGHBOUR}
    if kind == "path_traversal":
        facts["todo"], facts["secret"] = f"buy {rng.choice(['milk', 'tea', 'rice'])}\n", f"key-{rng.randrange(1 << 40)}\n"
        files.update({"notes/todo.txt": facts["todo"], "notes/sub/idea.txt": "idea\n", "secret.txt": facts["secret"]})
    elif kind == "command_injection":
        facts["lines"] = rng.randint(2, 9)
        files["data.txt"] = "".join(f"row {i}\n" for i in range(facts["lines"]))
    elif kind == "sql_injection":
        names = rng.sample(["ann", "bo", "cy", "di", "ed"], 3)
        facts["users"] = [[i + 1, n, f"{n}@example.test"] for i, n in enumerate(names)]
    elif kind == "unsafe_eval":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        facts["cases"] = [[f"{a}+{b}*3", a + b * 3], [f"({a}+{b})*2", (a + b) * 2], [f"{a * b}/{b}", a * b / b],
                          ["-4+1", -3]]
    else:
        facts["settings"] = {"lr": rng.choice([0.1, 0.01]), "name": rng.choice(["run", "job"]), "layers": rng.randint(1, 8)}
    text = (f"A security review flagged /app/{module}.py. Find the vulnerable function and fix it so that it is "
            f"safe against malicious input and still works for normal input. Then submit the name of the "
            f"function you fixed, e.g. <submit>function_name</submit>.\n")
    return Spec(f"sec_{kind}", text, files, facts, level, private)


def solve(spec: Spec) -> str:
    return f"#!/bin/bash\ncat > /app/{spec.facts['module']}.py <<'PY'\n{spec.private['fixed']}PY\n"


def partials(spec: Spec) -> list[str]:
    return [f"#!/bin/bash\ncat > /app/{spec.facts['module']}.py <<'PY'\n{spec.private['broken']}PY\n"]


def verify(spec: Spec) -> dict[str, str]:
    facts = {k: v for k, v in spec.facts.items() if k != "metadata"}
    kind = spec.facts["kind"]
    header = """
import importlib.util
path = "/app/%s.py" % FACTS["module"]
loader = importlib.util.spec_from_file_location(FACTS["module"], path)
module = importlib.util.module_from_spec(loader)
loader.loader.exec_module(module)
fn = getattr(module, FACTS["function"])
"""
    return python_tests(facts, header + TEMPLATES[kind][4])


PATTERNS = [Pattern("security", "security", "security", "find and fix a vulnerability; exploit tests",
                    instantiate, solve, verify, partials, agent_timeout=60.0, verifier_timeout=30.0)]
