"""The project's own Harbor tasks (tests/harbor_tasks), written the way public ones are:
`glmjax-envs validate` gives each the right verdict, with its reasons."""

import json
import os
import pathlib

from envs.cli import main
from envs.harbor import dirs as harbor_dirs
from envs.image import host_tools

TASKS = str(pathlib.Path(__file__).resolve().parents[2] / "harbor_tasks")


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
    assert ["pytest 8.4.1"] in [i.get("installed") for i in wt["environment"]["installs"]], notes  # the pin, fetched
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

    # a tool the host lacks: fetched from Debian's archive into the task's layer at build time
    clip = reports["clip-audio"]
    assert clip["status"] == "pass", clip
    if host_tools.apt_package("ffmpeg")[0] is not None:
        assert any(p.startswith("ffmpeg ") for i in clip["environment"]["installs"] for p in i["installed"]), clip

    # images built from the Dockerfile: data outside /app (a COPY to /data, a RUN writing /opt), a build context at
    # the task's root (compose `context: ..`, `COPY app/`), a pip and an apt package the host lacks, a Go base image
    for name in ("region-revenue", "invoice-rounding", "token-claims", "project-tree", "word-frequency-go"):
        assert reports[name]["status"] == "pass", reports[name]
    assert reports["region-revenue"]["environment"]["layer"] and not reports["invoice-rounding"]["environment"]["layer"]
    installed = {n: [p for i in reports[n]["environment"]["installs"] for p in i.get("installed", [])] for n in reports}
    assert "PyJWT 2.8.0" in installed["token-claims"] and any(p.startswith("tree ") for p in installed["project-tree"])
    go = reports["word-frequency-go"]["environment"]["notes"]
    assert any(n.startswith("FROM golang:1.22: Debian's golang-go") for n in go), go  # the stand-in, listed
    # a second container beside the task's: unsupported, naming the compose file and the service
    db = reports["orders-db"]
    assert db["status"] == "unsupported" and db["reason"].startswith("environment/docker-compose.yaml: service 'db'")

    # [[steps]]: each step's checks after the earlier steps' solutions, the trial's reward
    steps = reports["release-notes"]
    assert steps["status"] == "pass", steps
    assert {p["step"] for p in steps["checks"]["unfinished"]["probes"]} == {"release-notes.01-group",
                                                                          "release-notes.02-render"}


def test_the_whole_solution_folder_is_copied_and_its_error_shown(tmp_path):
    src = os.path.join(TASKS, "warehouse-totals")
    task = harbor_dirs.load_task(src)
    assert set(task.solution_files) == {"solve.py"} and "solve.py" in task.solution
    assert set(task.tests) == {"test.sh", "test_outputs.py"} and task.files.keys() == {"inventory.csv"}
    broken = task.replace(solution_files={"solve.py": b"import sys\nsys.exit('no inventory parser yet')\n"})
    from envs.harbor.validate import validate

    report = validate(broken)
    assert report.status == "fail" and "no inventory parser yet" in report.checks[0].detail, report.to_dict()


def test_a_multi_step_task_runs_step_by_step(tmp_path):
    from envs.shell import ShellEnv

    task = harbor_dirs.load_task(os.path.join(TASKS, "release-notes"))
    assert [s.id for s in task.steps] == ["release-notes.01-group", "release-notes.02-render"]
    assert task.steps[0].min_reward == 1.0 and task.step_reward == "mean"
    env = ShellEnv()
    try:
        prompt = env.reset(task)
        assert prompt.startswith("Group the commit subjects")
        # the first step falls short of its min_reward: the run ends there, the second counts 0
        _, reward, done, info = env.step("<bash>echo '{}' > /app/groups.json</bash><submit/>")
        assert done and reward == 0.0 and info["step_rewards"] == [0.0], info
        env.reset(task)
        obs, reward, done, info = env.step("<bash>bash /solution/solve.sh 2>/dev/null || python3 -c \""
                                           "import json; g = {}\nfor l in open('/app/commits.txt'):\n"
                                           "    k, _, v = l.strip().partition(': '); g.setdefault(k, []).append(v)\n"
                                           "json.dump(g, open('/app/groups.json', 'w'))\"</bash><submit/>")
        assert not done and info["step_reward"] == 1.0 and "[step 2 of 2]" in obs and "RELEASE.md" in obs, obs
        _, reward, done, info = env.step("<bash>printf '## Features\\n' > /app/RELEASE.md</bash><submit/>")
        assert done and reward == 0.5 and info["step_rewards"] == [1.0, 0.0], info
    finally:
        env.close()
    again = harbor_dirs.load_task(harbor_dirs.export_task(task, str(tmp_path)))
    assert [(s.id, s.instruction, s.solution, s.min_reward) for s in again.steps] == \
        [(s.id, s.instruction, s.solution, s.min_reward) for s in task.steps]


def test_a_weak_step_verifier_fails_the_unfinished_check(tmp_path):
    import shutil

    from envs.harbor.validate import validate

    copy = shutil.copytree(os.path.join(TASKS, "release-notes"), tmp_path / "release-notes")
    (copy / "steps" / "02-render" / "tests" / "test.sh").write_text(
        "#!/bin/bash\ngrep -q '^## Features' /app/RELEASE.md && echo 1 > /logs/verifier/reward.txt\n")
    report = validate(harbor_dirs.load_task(str(copy)))
    assert report.status == "fail" and not report.checks[2].passed, report.to_dict()
    failed = [p for p in report.checks[2].probes if p.get("reward")]
    assert failed and all(p["step"] == "release-notes.02-render" for p in failed)
