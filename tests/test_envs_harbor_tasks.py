"""The project's own Harbor tasks (tests/harbor_tasks), written the way public ones are:
`glmjax-envs validate` gives each the right verdict, with its reasons."""

import json
import os

from envs import harbor, host_tools
from envs.cli import main

TASKS = os.path.join(os.path.dirname(__file__), "harbor_tasks")


def test_each_task_gets_the_right_verdict(tmp_path, capsys):
    assert main(["validate", TASKS, "--out", str(tmp_path)]) == 1  # not all pass: some are meant not to
    reports = {r["task"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert sorted(reports) == sorted(os.listdir(TASKS))
    assert sorted(os.listdir(tmp_path)) == sorted(f"{name}.json" for name in reports)

    # apt-get / pip lines, COPY into /app without a slash, uv's installer, uvx pytest --ctrf,
    # solve.sh calling solve.py: accepted, each install step noted with what satisfied it
    wt = reports["warehouse-totals"]
    assert wt["status"] == "pass", wt
    notes = [n for i in wt["environment"]["installs"] for n in i["notes"]]
    assert any(n.startswith("jq ") and "installed on the host" in n for n in notes), notes
    assert any(n.startswith("pytest") and "8.4.1 asked" in n for n in notes), notes
    assert any("uv installer" in n for n in notes) and not any(i["missing"] for i in wt["environment"]["installs"])
    assert "memory=" in wt["environment"]["isolation"]
    state = [p for p in wt["checks"]["unfinished"]["probes"] if p["kind"] == "state"]
    assert state and all(p["reward"] == 0.0 for p in state)  # a one-command oracle, checked through its files

    # Terminal-Bench's older layout: uv venv, uv pip install, uv run pytest
    assert reports["tb-dedupe-log"]["status"] == "pass", reports["tb-dedupe-log"]

    # a verifier that never checks the number: a half-written count still passes it
    weak = reports["line-count-weak"]
    assert weak["status"] == "fail" and not weak["checks"]["unfinished"]["passed"], weak
    assert weak["checks"]["oracle"]["passed"] and weak["checks"]["noop"]["passed"]

    # a tool the host lacks: unsupported, the report names it
    clip = reports["clip-audio"]
    if host_tools.apt_package("ffmpeg")[0] is not None:
        assert clip["status"] == "unsupported" and "ffmpeg is not on this host" in clip["reason"], clip
    else:
        assert clip["status"] == "pass", clip

    # per-step instructions: unsupported, and why
    steps = reports["release-notes"]
    assert steps["status"] == "unsupported" and "2 [[steps]]" in steps["reason"] and "'02-render'" in steps["reason"]


def test_the_whole_solution_folder_is_copied_and_its_error_shown(tmp_path):
    src = os.path.join(TASKS, "warehouse-totals")
    task = harbor.load_task(src)
    assert set(task.solution_files) == {"solve.py"} and "solve.py" in task.solution
    assert set(task.tests) == {"test.sh", "test_outputs.py"} and task.files.keys() == {"inventory.csv"}
    broken = task.replace(solution_files={"solve.py": b"import sys\nsys.exit('no inventory parser yet')\n"})
    from envs.validate import validate

    report = validate(broken)
    assert report.status == "fail" and "no inventory parser yet" in report.checks[0].detail, report.to_dict()
