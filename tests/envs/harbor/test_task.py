"""Harbor / Terminal-Bench task directories: load, run locally, export, and `glmjax-envs validate`."""

import json
import os

import pytest

from envs.cli import main
from envs.harbor import dirs as harbor_dirs
from envs.harbor.validate import validate
from tests.harbor_util import GOOD_SOLVE, GOOD_TEST, write_task

BROKEN = {  # verifier -> the check that must reject it
    "always_passes": ("#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n", "noop"),
    "file_exists_only": ("#!/bin/bash\ntest -f /app/result.txt\n", "unfinished"),
    "fails_the_oracle": (GOOD_TEST.replace("gamma')", "gamma\\ndelta')"), "oracle"),
    "crashes": ("#!/bin/bash\npython3 -c 'import glmjax_no_such_module'\n", "oracle"),
    "hangs": ("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\nsleep 600\n", "oracle"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_check_catches_the_broken_verifier_it_exists_for(tmp_path, name):
    test, check = BROKEN[name]
    # Only the hanging verifier needs a short limit; the others must finish even on a busy machine.
    task = harbor_dirs.load_task(str(write_task(tmp_path, name, test=test, verifier_timeout=1.0 if name == "hangs" else 20.0)))
    report = validate(task)
    failed = [c.name for c in report.checks if not c.passed]
    assert report.status == "fail" and check in failed, report.to_dict()
    if name == "hangs":
        assert "killed" in report.checks[0].detail


def test_good_verifier_passes_all_three(tmp_path):
    report = validate(harbor_dirs.load_task(str(write_task(tmp_path, "good"))))
    assert report.passed, report.to_dict()
    unfinished = report.to_dict()["checks"]["unfinished"]["probes"]
    cuts = [p for p in unfinished if p["kind"] == "cut" and "reward" in p]
    states = [p for p in unfinished if p["kind"] == "state" and "reward" in p]
    assert len(cuts) == 2  # after alpha, after beta
    assert [p["name"] for p in states] == ["the last write cut short"] and states[0]["left_out_or_cut"] == ["result.txt"]


def test_a_one_command_oracle_is_checked_through_its_effect_on_the_files(tmp_path):
    solve = "#!/bin/bash\nprintf 'alpha\\nbeta\\ngamma\\n' > /app/result.txt\n"
    report = validate(harbor_dirs.load_task(str(write_task(tmp_path, "one", solve=solve))))
    assert report.passed, report.to_dict()
    probes = report.to_dict()["checks"]["unfinished"]["probes"]
    assert [(p["kind"], p["reward"]) for p in probes if "reward" in p] == [("state", 0.0)]
    weak = harbor_dirs.load_task(str(write_task(tmp_path, "weak", solve=solve, test=BROKEN["file_exists_only"][0])))
    report = validate(weak)  # a half-written result.txt still exists: the weak verifier is caught
    assert report.status == "fail" and not report.checks[2].passed, report.to_dict()


def test_without_any_unfinished_probe_the_verifier_is_rejected(tmp_path):
    solve = "#!/bin/bash\ntouch /app/done\n"  # an empty file: nothing to cut short, nothing before it
    test = "#!/bin/bash\ntest -e /app/done\n"
    report = validate(harbor_dirs.load_task(str(write_task(tmp_path, "empty", solve=solve, test=test))))
    assert report.status == "fail" and "no unfinished probe" in report.checks[2].detail, report.to_dict()


def test_reward_json_and_exit_status(tmp_path):
    as_json = GOOD_TEST.replace("echo 1 > /logs/verifier/reward.txt", "echo '{\"reward\": 1.0}' > /logs/verifier/reward.json")
    as_json = as_json.replace("echo 0 > /logs/verifier/reward.txt", "echo '{\"reward\": 0}' > /logs/verifier/reward.json")
    by_exit = "#!/bin/bash\n[ \"$(cat /app/result.txt)\" = \"$(printf 'alpha\\nbeta\\ngamma')\" ]\n"
    for name, test, source in (("json", as_json, "reward.json"), ("exit", by_exit, "exit status")):
        report = validate(harbor_dirs.load_task(str(write_task(tmp_path, name, test=test))))
        assert report.passed, report.to_dict()
        assert report.checks[0].probes[0]["source"] == source


def test_dockerfile_is_emulated_and_workdir_mapped(tmp_path):
    docker = "FROM python:3.11-slim\nWORKDIR /workspace\nENV GREETING=hello\nCOPY data/ /workspace/data/\nRUN mkdir -p /workspace/out\n"
    solve = "#!/bin/bash\ncp /workspace/data/in.txt /workspace/out/a.txt\necho $GREETING >> /workspace/out/a.txt\n"
    test = "#!/bin/bash\n[ \"$(cat /workspace/out/a.txt)\" = \"$(printf 'x\\nhello')\" ]\n"
    task = harbor_dirs.load_task(str(write_task(tmp_path, "docker", solve=solve, test=test, dockerfile=docker,
                                           files={"data/in.txt": "x\n"})))
    assert task.workdir == "/workspace" and task.files == {"data/in.txt": b"x\n"} and task.env == {"GREETING": "hello"}
    assert task.unsupported is None
    assert validate(task).passed
    assert validate(task, filesystem="plain").passed  # the fallback rewrites the paths instead


def test_agent_commands_run_under_the_images_user_name_with_the_environments_variables(tmp_path):
    docker = "FROM ubuntu:24.04\nRUN useradd --create-home agent\nWORKDIR /app\n"
    solve = "#!/bin/bash\necho \"$(whoami) $GREETING\" > /app/who.txt\n"
    test = "#!/bin/bash\n[ \"$(cat /app/who.txt)\" = \"agent hi\" ]\n"
    task = harbor_dirs.load_task(str(write_task(tmp_path, "user", solve=solve, test=test, dockerfile=docker,
                                                extra_toml='user = "agent"\n\n[environment.env]\nGREETING = "hi"\n')))
    assert task.user == "agent" and task.env["GREETING"] == "hi"
    report = validate(task)
    assert report.passed, report.to_dict()


@pytest.mark.parametrize("case", ["apt", "compose", "add_url", "run_fails", "test_needs_network"])
def test_environments_that_cannot_be_set_up_are_unsupported(tmp_path, case):
    docker = {"apt": "FROM ubuntu\nRUN apt-get update && apt-get install -y jq glmjax-no-such-package\n",
              "compose": "FROM ubuntu\n",
              "add_url": "FROM ubuntu\nWORKDIR /app\nADD https://example.com/tool /usr/local/bin/tool\n",
              "run_fails": "FROM ubuntu\nWORKDIR /app\nRUN false\n", "test_needs_network": "FROM ubuntu\n"}[case]
    test = ("#!/bin/bash\nwget -q https://example.com/expected.txt\n" + GOOD_TEST.split("\n", 1)[1]
            if case == "test_needs_network" else GOOD_TEST)
    path = write_task(tmp_path, case, dockerfile=docker, files={"tool": "#!/bin/sh\n"}, test=test)
    if case == "compose":  # a second container beside the task's
        (path / "environment" / "docker-compose.yaml").write_text(
            "services:\n  main:\n    build: .\n  db:\n    image: postgres:16\n")
    report = validate(harbor_dirs.load_task(str(path)))
    assert report.status == "unsupported" and report.reason, report.to_dict()
    named = {"apt": "glmjax-no-such-package", "compose": "docker-compose.yaml: service 'db'",
             "add_url": "line 3: ADD https://example.com/tool", "run_fails": "line 3: RUN false fails",
             "test_needs_network": "https://example.com/expected.txt"}[case]
    assert named in report.reason, report.reason


def test_terminal_bench_format(tmp_path):
    task = tmp_path / "tb-task"
    (task / "tests").mkdir(parents=True)
    (task / "task.yaml").write_text("instruction: |\n  Write /app/result.txt with the lines alpha, beta, gamma.\n"
                                    "difficulty: medium\ncategory: file-ops\nmax_agent_timeout_sec: 60\n"
                                    "max_test_timeout_sec: 30\n")
    (task / "Dockerfile").write_text("FROM ghcr.io/laude-institute/t-bench/python-3-13:latest\nWORKDIR /app\n")
    (task / "docker-compose.yaml").write_text("services:\n  client:\n    build: .\n")
    (task / "solution.sh").write_text(GOOD_SOLVE)
    (task / "run-tests.sh").write_text("#!/bin/bash\npython3 $TEST_DIR/test_outputs.py\n")
    (task / "tests" / "test_outputs.py").write_text(
        "assert open('/app/result.txt').read() == 'alpha\\nbeta\\ngamma\\n'\n")
    loaded = harbor_dirs.load_task(str(task))
    assert loaded.instruction.startswith("Write /app/result.txt") and loaded.difficulty == 3
    assert loaded.verifier_timeout == 30.0 and loaded.test_command == "bash /tests/run-tests.sh"
    assert validate(loaded).passed


def test_export_round_trip(tmp_path):
    original = harbor_dirs.load_task(str(write_task(tmp_path / "src", "round")))
    original = original.replace(partials=("#!/bin/bash\necho alpha > /app/result.txt\n",), files={"seed.txt": "s\n"})
    path = harbor_dirs.export_task(original, str(tmp_path / "out"))
    again = harbor_dirs.load_task(path)
    assert (again.instruction, again.solution, again.partials, again.difficulty) == \
        (original.instruction, original.solution, original.partials, original.difficulty)
    assert again.files == {"seed.txt": b"s\n"} and set(again.tests) == {"test.sh"}
    assert validate(again).passed


def test_cli_validate_folder_of_harbor_tasks(tmp_path, capsys):
    folder = tmp_path / "tasks"
    write_task(folder, "good-a")
    write_task(folder, "good-b", solve=GOOD_SOLVE.replace("set -e\n", ""))
    reports = tmp_path / "reports"
    assert main(["validate", str(folder), "--out", str(reports)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["status"] for r in lines] == ["pass", "pass"]
    assert sorted(os.listdir(reports)) == ["good-a.json", "good-b.json"]
    write_task(folder, "bad", test=BROKEN["always_passes"][0])
    assert main(["validate", str(folder)]) == 1
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["task"]: r["status"] for r in out}["bad"] == "fail"
    assert main(["validate", str(tmp_path / "empty-dir-that-is-missing")]) == 2


SANDBOX_LIMITS = {  # an oracle that fails for a reason of the sandbox's, not the task's -> the reason
    "missing_tool": ("glmjax-no-such-tool --version > /app/result.txt\n", "it needs glmjax-no-such-tool"),
    "read_only_system_dir": ("echo x > /var/log/app.log\n", "it changes /var/log/app.log"),
    "moves_the_verifiers_dir": ("mv /tests /tmp/tests-moved\n", "it touches /tests, which only the verifier"),
    "needs_root": ("python3 -c \"import os; os.setuid(0)\"\n", "it needs root"),
    "background_service": ("(python3 -m http.server 8765 >/dev/null 2>&1 &)\nsleep 0.5\n",
                           "processes the solution starts do not outlive its command"),
}


@pytest.mark.parametrize("case", sorted(SANDBOX_LIMITS))
def test_an_oracle_failing_on_a_sandbox_limit_is_unsupported_and_says_why(tmp_path, case):
    solve, why = SANDBOX_LIMITS[case]
    test = GOOD_TEST if case != "background_service" else (
        "#!/bin/bash\npython3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/')\" && "
        "echo 1 > /logs/verifier/reward.txt\n")
    report = validate(harbor_dirs.load_task(str(write_task(tmp_path, case, solve="#!/bin/bash\nset -e\n" + solve, test=test))))
    assert report.status == "unsupported" and why in report.reason, report.to_dict()
    assert not report.checks[0].passed  # the checks that ran stay in the report


def test_the_tasks_storage_raises_the_file_size_cap_and_tests_may_write_beside_themselves(tmp_path):
    solve = "#!/bin/bash\nset -e\npython3 -c \"open('/app/big', 'wb').truncate(200 << 20)\"\n" + GOOD_SOLVE.split("\n", 1)[1]
    test = "#!/bin/bash\ntouch /tests/.scratch || exit 3\n" + GOOD_TEST.split("\n", 1)[1]
    path = write_task(tmp_path, "big", solve=solve, test=test)
    small = validate(harbor_dirs.load_task(str(path)))
    assert small.status == "unsupported" and "larger than the sandbox allows" in small.reason, small.to_dict()
    (path / "task.toml").write_text((path / "task.toml").read_text() + "\n[environment]\nstorage_mb = 1024\n")
    task = harbor_dirs.load_task(str(path))
    assert task.storage_bytes == 1024 << 20
    assert validate(task).passed


def test_tests_that_run_a_file_the_agent_can_change_are_noted(tmp_path):
    test = "#!/bin/bash\npython3 /app/check.py && echo 1 > /logs/verifier/reward.txt\n"
    task = harbor_dirs.load_task(str(write_task(tmp_path, "self-check", test=test)))
    assert task.notes[-1].startswith("tests/test.sh runs /app/check.py, which the agent can change")


def test_cli_validate_keeps_reports_of_tasks_that_share_a_name(tmp_path, capsys):
    for name in ("a", "b"):
        write_task(tmp_path / "tasks", name, extra_toml='\n[task]\nname = "someone/log-report"\n')
    assert main(["validate", str(tmp_path / "tasks"), "--out", str(tmp_path / "reports")]) == 0
    assert sorted(os.listdir(tmp_path / "reports")) == ["log-report-2.json", "log-report.json"]
    sources = {json.loads(line)["source"] for line in capsys.readouterr().out.splitlines()}
    assert len(sources) == 2


def test_a_terminated_validate_leaves_no_sandbox_behind(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    write_task(tmp_path / "tasks", "slow", solve="#!/bin/bash\nsleep 60\n")
    boxes = tmp_path / "boxes"
    boxes.mkdir()
    env = dict(os.environ, GLMJAX_SANDBOX_DIR=str(boxes))
    proc = subprocess.Popen([sys.executable, "-m", "envs.cli", "validate", str(tmp_path / "tasks")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not os.listdir(boxes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(boxes), "the oracle run never started"
    time.sleep(1.0)  # inside the oracle's sleep
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    assert os.listdir(boxes) == [] and b"Traceback" not in err, err.decode()[-2000:]


def test_a_check_that_crashes_is_that_tasks_error_report_and_the_run_goes_on(tmp_path, monkeypatch):
    from envs.harbor import validate as validate_module

    good, bad = (harbor_dirs.load_task(str(write_task(tmp_path, name))) for name in ("good", "crashes"))
    real = validate_module.prepare

    def prepare(sandbox, task):
        if task.id == "crashes":
            raise IsADirectoryError(21, "Is a directory", "/app/.")
        return real(sandbox, task)

    monkeypatch.setattr(validate_module, "prepare", prepare)
    reports = validate_module.validate_all([bad, good])
    assert [r.status for r in reports] == ["error", "pass"]
    assert reports[0].reason == "the check could not run: IsADirectoryError: [Errno 21] Is a directory: '/app/.'"
