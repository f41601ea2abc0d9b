"""Terminal tasks: file and text work in the shell, each with an oracle and tests.

Eight patterns, each seeded data plus a precise instruction; difficulty scales the data
(more lines, files, ties, distractors). Oracles are plain shell (awk, sort, sed, mv) and
take several statements, the last one completing the work, so the unfinished check has
cut points. Verifiers are Python written from the facts of the spec.
"""

from __future__ import annotations

import json
import random
import shlex

from envs.families.pattern import Pattern, Spec, python_tests

_WORDS = ("alpha bravo cedar delta ember fjord gale harbor iris jade kestrel lumen maple nova "
          "onyx pine quill raven sable tidal umber vale willow xenon yarrow zephyr").split()


def _name(rng: random.Random) -> str:
    return rng.choice(_WORDS) + str(rng.randint(1, 99))


# ----- count_errors ---------------------------------------------------------------------------
def _count_errors(rng: random.Random, d: int) -> Spec:
    level = rng.choice(["ERROR", "WARN"])
    lines = []
    for i in range(12 * d + 8):
        lv = rng.choice(["INFO", "INFO", "DEBUG", "WARN", "ERROR"])
        msg = rng.choice(["disk usage high", "request served", f"{level} budget checked", "retrying", "cache miss"])
        lines.append(f"2024-05-0{rng.randint(1, 9)}T{i % 24:02d}:{rng.randint(0, 59):02d} {lv} {_name(rng)}: {msg}")
    count = sum(line.split()[1] == level for line in lines)
    text = (f"/app/server.log has one entry per line: a timestamp, a level, a component and a message. "
            f"Count the lines whose level (the second field) is exactly {level} and write that number, "
            f"digits only, to /app/answer.txt.\n")
    return Spec("count_errors", text, {"server.log": "\n".join(lines) + "\n"}, {"count": count, "level": level}, d)


def _count_errors_solve(spec: Spec) -> str:
    level = spec.facts["level"]
    return (f"#!/bin/bash\nawk '$2 == \"{level}\"' /app/server.log > /app/matches.log\n"
            "wc -l < /app/matches.log > /app/answer.txt\n")


def _count_errors_verify(spec: Spec) -> dict[str, str]:
    return python_tests(spec.facts, """
with open("/app/answer.txt") as f:
    assert f.read().strip() == str(FACTS["count"])
""")


# ----- sort_csv -------------------------------------------------------------------------------------
def _sort_csv(rng: random.Random, d: int) -> Spec:
    rows = [(rng.choice(_WORDS) + rng.choice("abcxyz"), rng.randint(0, 10 + 10 * (5 - d))) for _ in range(4 + 3 * d)]
    rows = list(dict(rows).items())
    expected = ["name,score"] + [f"{n},{s}" for n, s in sorted(rows, key=lambda r: (-r[1], r[0]))]
    text = ("/app/data.csv has a header line `name,score` and one row per name. Write /app/sorted.csv: "
            "the same header, then the rows sorted by score from highest to lowest, rows with equal "
            "scores ordered by name (ascending, byte order).\n")
    body = "name,score\n" + "".join(f"{n},{s}\n" for n, s in rows)
    return Spec("sort_csv", text, {"data.csv": body}, {"expected": expected}, d)


def _sort_csv_solve(spec: Spec) -> str:
    return ("#!/bin/bash\nhead -n 1 /app/data.csv > /app/sorted.csv.tmp\n"
            "tail -n +2 /app/data.csv | LC_ALL=C sort -t, -k2,2nr -k1,1 >> /app/sorted.csv.tmp\n"
            "mv /app/sorted.csv.tmp /app/sorted.csv\n")


def _lines_verify(path: str):
    return lambda spec: python_tests(spec.facts, f"""
with open({path!r}) as f:
    assert f.read().splitlines() == FACTS["expected"], "content differs"
""")


# ----- rename_ext -------------------------------------------------------------------------------------
def _rename_ext(rng: random.Random, d: int) -> Spec:
    names = rng.sample(_WORDS, 2 + d + 2)
    txt, other = names[: 2 + d], names[2 + d:]
    files = {f"docs/{n}.txt": f"{n} notes {rng.randint(0, 999)}\n" for n in txt}
    files.update({f"docs/{n}.log": f"log {rng.randint(0, 999)}\n" for n in other})
    expected = {(k[:-4] + ".md" if k.endswith(".txt") else k): v for k, v in files.items()}
    text = ("Rename every file in /app/docs whose name ends in .txt so that it ends in .md instead "
            "(same base name, same contents). Leave all other files as they are.\n")
    return Spec("rename_ext", text, files, {"expected": expected, "txt": txt}, d)


def _rename_ext_solve(spec: Spec) -> str:
    return "#!/bin/bash\ncd /app/docs\n" + "".join(f"mv {n}.txt {n}.md\n" for n in spec.facts["txt"])


def _tree_verify(spec: Spec) -> dict[str, str]:
    return python_tests(spec.facts, """
found = {}
for root, _, names in os.walk("/app/docs"):
    for name in names:
        with open(os.path.join(root, name)) as f:
            found["docs/" + os.path.relpath(os.path.join(root, name), "/app/docs")] = f.read()
assert found == FACTS["expected"], sorted(set(found) ^ set(FACTS["expected"]))
""")


# ----- unique_ips --------------------------------------------------------------------------------------
def _unique_ips(rng: random.Random, d: int) -> Spec:
    pool = [f"10.{rng.randint(0, 3)}.{rng.randint(0, 20)}.{rng.randint(1, 254)}" for _ in range(3 + 2 * d)]
    lines = [f'{rng.choice(pool)} - - [01/May/2024:10:{i % 60:02d}:00] "GET /{rng.choice(_WORDS)} HTTP/1.1" 200 '
             f'{rng.randint(100, 9999)}' for i in range(10 + 10 * d)]
    seen = {line.split()[0] for line in lines}
    expected = sorted(seen, key=lambda ip: tuple(int(p) for p in ip.split(".")))
    text = ("Each line of /app/access.log starts with the client's IPv4 address. Write every distinct "
            "address to /app/ips.txt, one per line, sorted numerically (by first octet, then second, "
            "third, fourth).\n")
    return Spec("unique_ips", text, {"access.log": "\n".join(lines) + "\n"}, {"expected": expected}, d)


def _unique_ips_solve(spec: Spec) -> str:
    return ("#!/bin/bash\ncut -d' ' -f1 /app/access.log > /app/all_ips.txt\n"
            "sort -u -t. -k1,1n -k2,2n -k3,3n -k4,4n /app/all_ips.txt > /app/ips.txt\n")


# ----- replace_config --------------------------------------------------------------------------------
def _replace_config(rng: random.Random, d: int) -> Spec:
    old, new = f"{rng.choice(_WORDS)}.internal", f"{rng.choice(_WORDS)}.example.org"
    files, expected, targets = {}, {}, []
    for i, name in enumerate(rng.sample(_WORDS, 2 + d)):  # the first two always need the edit
        lines = [f"port={rng.randint(1000, 9999)}", f"host={old if i < 2 or rng.random() < 0.6 else 'localhost'}",
                 f"# old host was {old}", f"name={name}"]
        rng.shuffle(lines)
        files[f"conf/{name}.conf"] = "\n".join(lines) + "\n"
        expected[f"conf/{name}.conf"] = "\n".join(ln.replace(f"host={old}", f"host={new}") if ln.startswith("host=")
                                                  else ln for ln in lines) + "\n"
        targets += [name] if f"host={old}" in lines else []
    files["conf/README"] = f"host={old} is documented here and must stay\n"
    expected["conf/README"] = files["conf/README"]
    text = (f"In every file ending in .conf under /app/conf, change the line `host={old}` to `host={new}`. "
            f"Change nothing else (comments and other files stay as they are).\n")
    return Spec("replace_config", text, files, {"expected": expected, "old": old, "new": new, "targets": targets}, d)


def _replace_config_solve(spec: Spec) -> str:
    old, new = spec.facts["old"].replace(".", r"\."), spec.facts["new"]
    edits = [f"sed -i 's/^host={old}$/host={new}/' /app/conf/{n}.conf\n" for n in spec.facts["targets"]]
    return "#!/bin/bash\n" + "".join(edits)


def _files_verify(spec: Spec) -> dict[str, str]:
    return python_tests(spec.facts, """
for rel, want in FACTS["expected"].items():
    with open(os.path.join("/app", rel)) as f:
        assert f.read() == want, rel
""")


# ----- column_totals --------------------------------------------------------------------------------
def _column_totals(rng: random.Random, d: int) -> Spec:
    regions = rng.sample(["north", "south", "east", "west", "central", "coast", "alpine"], 2 + min(d, 4))
    rows = [(rng.choice(regions), rng.randint(1, 500)) for _ in range(8 + 6 * d)]
    totals = {}
    for region, amount in rows:
        totals[region] = totals.get(region, 0) + amount
    expected = [f"{r} {totals[r]}" for r in sorted(totals)]
    text = ("/app/sales.tsv has two tab-separated columns, region and amount (an integer), no header. "
            "Write /app/totals.txt with one line per region, `region total` (one space), sorted by region name.\n")
    body = "".join(f"{r}\t{a}\n" for r, a in rows)
    return Spec("column_totals", text, {"sales.tsv": body}, {"expected": expected}, d)


def _column_totals_solve(spec: Spec) -> str:
    return ("#!/bin/bash\n"
            "awk -F'\\t' '{t[$1] += $2} END {for (r in t) print r, t[r]}' /app/sales.tsv > /app/totals.unsorted\n"
            "LC_ALL=C sort /app/totals.unsorted > /app/totals.txt\n")


# ----- make_tree -----------------------------------------------------------------------------------------
def _make_tree(rng: random.Random, d: int) -> Spec:
    project = rng.choice(_WORDS)
    version = f"{rng.randint(0, 9)}.{rng.randint(0, 20)}.0\n"
    files = {f"{project}/README.md": f"# {project}\n", f"{project}/VERSION": version}
    for name in rng.sample(_WORDS, d):
        files[f"{project}/{rng.choice(['src', 'lib', 'docs'])}/{name}.txt"] = f"{name}\n"
    listing = "\n".join(f"- `/app/{p}` containing exactly `{c.strip()}` and a newline" for p, c in files.items())
    text = f"Create these files (and the directories they need):\n{listing}\n"
    return Spec("make_tree", text, {}, {"expected": files}, d)


def _make_tree_solve(spec: Spec) -> str:
    out = ["#!/bin/bash"]
    for rel, content in spec.facts["expected"].items():
        path = shlex.quote(f"/app/{rel}")
        out += [f"mkdir -p $(dirname {path})", f"printf '%s\\n' {shlex.quote(content.strip())} > {path}"]
    return "\n".join(out) + "\n"


# ----- active_emails -----------------------------------------------------------------------------
def _active_emails(rng: random.Random, d: int) -> Spec:
    users = [{"name": n, "email": f"{n}@{rng.choice(['corp', 'mail'])}.test", "active": rng.random() < 0.6}
             for n in rng.sample(_WORDS, 3 + 2 * d)]
    if d >= 3:
        users[0]["note"] = "active: true in the past"
    expected = [u["email"] for u in users if u["active"]]
    text = ("/app/users.jsonl has one JSON object per line with fields name, email and active (a boolean). "
            "Write the emails of the users whose active field is true to /app/active_emails.txt, one per line, "
            "in the order they appear.\n")
    body = "".join(json.dumps(u) + "\n" for u in users)
    return Spec("active_emails", text, {"users.jsonl": body}, {"expected": expected}, d)


def _active_emails_solve(spec: Spec) -> str:
    return ("#!/bin/bash\npython3 -c '\nimport json\nfor line in open(\"/app/users.jsonl\"):\n"
            "    u = json.loads(line)\n    if u[\"active\"] is True:\n        print(u[\"email\"])\n' > /app/emails.tmp\n"
            "mv /app/emails.tmp /app/active_emails.txt\n")


def _p(name, instantiate, solve, verify, description):
    return Pattern(name, "terminal", "terminal", description, instantiate, solve, verify,
                   agent_timeout=60.0, verifier_timeout=30.0)


PATTERNS = [
    _p("count_errors", _count_errors, _count_errors_solve, _count_errors_verify, "count log lines by a field"),
    _p("sort_csv", _sort_csv, _sort_csv_solve, _lines_verify("/app/sorted.csv"), "sort a CSV with ties"),
    _p("rename_ext", _rename_ext, _rename_ext_solve, _tree_verify, "rename files by extension"),
    _p("unique_ips", _unique_ips, _unique_ips_solve, _lines_verify("/app/ips.txt"), "distinct values, numeric sort"),
    _p("replace_config", _replace_config, _replace_config_solve, _files_verify, "targeted in-place edits"),
    _p("column_totals", _column_totals, _column_totals_solve, _lines_verify("/app/totals.txt"), "group and sum"),
    _p("make_tree", _make_tree, _make_tree_solve, _files_verify, "create a directory tree with contents"),
    _p("active_emails", _active_emails, _active_emails_solve, _lines_verify("/app/active_emails.txt"), "filter JSON lines"),
]
