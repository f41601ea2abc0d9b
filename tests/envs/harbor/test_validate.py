"""The three checks on text tasks, cut points through solve.sh, and the JSON report."""

import json

import pytest

from envs.base import ExactAnswer, TextTask
from envs.harbor.task import HarborTask
from envs.harbor.validate import cut_points, validate, validate_all


def _text(verifier, answer="19\n", partials=()):
    return TextTask(id="t", instruction="12+7=", domain="reasoning", answer=answer, verifier=verifier, partials=partials)


def test_text_checks_catch_broken_verifiers():
    assert validate(_text(ExactAnswer("19"))).passed
    always = validate(_text(lambda a: 1.0))
    prefix = validate(_text(lambda a: 1.0 if a and "19".startswith(a) else 0.0))
    wrong = validate(_text(ExactAnswer("20")))
    lenient_partial = validate(_text(lambda a: 1.0 if a in ("19", "9") else 0.0, partials=("9\n",)))
    failed = lambda r: [c.name for c in r.checks if not c.passed]  # noqa: E731
    assert failed(always) == ["noop", "unfinished"]
    assert failed(prefix) == ["unfinished"]
    assert failed(wrong) == ["oracle"]
    assert failed(lenient_partial) == ["unfinished"]


def test_cut_points_respect_statements():
    script = ("#!/bin/bash\nset -e\ncd /app\necho a > x\ncat > y <<'EOF'\nline one\nline two\nEOF\n"
              "if true; then\n  echo b >> x\nfi\nfor i in 1 2; do\n  echo $i\ndone\nmv x z\n")
    cuts = cut_points(script, n=10)
    ends = [c.splitlines()[-1] for c in cuts]
    assert ends == ["echo a > x", "EOF", "fi", "done"]
    assert len(cut_points(script, n=2)) == 2 and cut_points(script, n=2)[-1] == cuts[-1]
    assert cut_points("#!/bin/bash\necho only\n") == []


def test_cuts_that_leave_the_oracle_state_are_skipped():
    test = '#!/bin/bash\ntest "$(cat /app/r)" = "$(printf "a\\nb")"\n'
    task = HarborTask(id="skip", instruction="write a then b to /app/r", domain="terminal",
                      solution="echo a > /app/r\necho b >> /app/r\necho finished\n", tests={"test.sh": test})
    report = validate(task)
    assert report.passed, report.to_dict()
    probes = report.to_dict()["checks"]["unfinished"]["probes"]
    assert any(p.get("skipped") for p in probes) and any(p.get("reward") == 0.0 for p in probes)
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data) == {"task", "status", "source", "reason", "seconds", "checks", "environment"}
    assert set(data["checks"]) == {"oracle", "noop", "unfinished"}


def test_missing_solution_and_bad_types():
    task = HarborTask(id="nosol", instruction="x", domain="terminal", tests={"test.sh": "exit 0\n"})
    assert validate(task).status == "fail" and "no solution" in validate(task).reason
    with pytest.raises(TypeError, match="TextTask or HarborTask"):
        validate("not a task")
    reports = validate_all([_text(ExactAnswer("19")), _text(ExactAnswer("20"))], workers=2)
    assert [r.status for r in reports] == ["pass", "fail"]
