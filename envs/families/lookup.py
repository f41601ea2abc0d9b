"""Lookup tasks: the answer is in a file the agent has to read, small enough for a tiny
byte-level model to learn agentic RL on, and impossible without reading observations.

    d1  "Write the value of oak in kv to ans."       kv: elm=teal / oak=ruby / fir=snow ...
        agent:  <bash>grep oak= kv</bash>  ->  oak=ruby  ->  <bash>echo ruby >ans</bash><submit/>
    d2  the value is a reference "@f4": the answer is the content of file f4 (one more turn):
        "Write the value of oak in kv to ans. @F: file F holds it."
    d3+ more lines, keys that share a prefix (grep oak matches oak and oaky)

The values are drawn from 16 colour names, so an agent that does not read what its
command printed can only guess (one in 16). Each task carries its demonstration (``metadata["demonstration"]``: the agent's
actions, as above) for supervised warm-up; the observations in between come from running
them. The verifier is one shell comparison (cheap enough to run thousands of episodes).
"""

from __future__ import annotations

import random

from envs.families.pattern import Pattern, Spec

_KEYS = "ash elm fir oak yew bay box fig gum ivy lime nut pear plum rose sage teak vine".split()
_VALUES = "red tan blue cyan gold gray navy pink ruby sand teal wine amber coral olive snow".split()

VERIFY_SH = """#!/bin/bash
# Written from the task's specification, without the reference solution.
mkdir -p /logs/verifier
if [ "$(cat /app/ans 2>/dev/null)" = "{answer}" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def _lookup(rng: random.Random, d: int) -> Spec:
    n = 3 + d
    keys = rng.sample(_KEYS, n)
    if d >= 3:  # a distractor whose name starts with the key: grep without '=' finds both
        keys[1] = keys[0] + rng.choice("sy")
    values = [rng.choice(_VALUES) for _ in keys]
    key, answer = keys[0], values[0]
    files, hops = {}, []
    if d >= 2:
        ref = rng.choice("abcdef") + str(rng.randint(1, 9))
        files[ref] = answer + "\n"
        values[0], hops = "@" + ref, [ref]
    order = list(range(n))
    rng.shuffle(order)
    files["kv"] = "".join(f"{keys[i]}={values[i]}\n" for i in order)
    text = f"Write the value of {key} in kv to ans." + ("" if d == 1 else " @F: file F holds it.")
    return Spec("lookup", text + "\n", files, {"key": key, "answer": answer, "hops": hops}, d)


def _solve(spec: Spec) -> str:
    key = spec.facts["key"]
    if spec.facts["hops"]:
        return f"#!/bin/bash\ncd /app\ncat \"$(grep '^{key}=' kv | cut -d@ -f2)\" > ans\n"
    return f"#!/bin/bash\ngrep '^{key}=' /app/kv | cut -d= -f2 > /app/ans\n"


def _verify(spec: Spec) -> dict[str, str]:
    return {"test.sh": VERIFY_SH.replace("{answer}", spec.facts["answer"])}


def _partials(spec: Spec) -> list[str]:
    """Half-done work that must score 0: the key's line, not its value; the reference, not
    what it points to."""
    key = spec.facts["key"]
    out = [f"#!/bin/bash\ngrep '^{key}=' /app/kv > /app/ans\n"]
    if spec.facts["hops"]:
        out.append(f"#!/bin/bash\ngrep '^{key}=' /app/kv | cut -d@ -f2 > /app/ans\n")
    return out


def demonstration(spec: Spec) -> list[str]:
    """The agent's actions on this task, one model turn each."""
    key, answer = spec.facts["key"], spec.facts["answer"]
    turns = [f"<bash>grep {key}= kv</bash>"]
    turns += [f"<bash>cat {hop}</bash>" for hop in spec.facts["hops"]]
    return turns + [f"<bash>echo {answer} >ans</bash><submit/>"]


PATTERNS = [Pattern("lookup", "lookup", "terminal", "read a value from a file (through references at d2+)",
                   _lookup, _solve, _verify, _partials, demonstration, agent_timeout=10.0, verifier_timeout=10.0)]
