"""Harbor task directories written the way public ones are, for the envs tests."""

GOOD_SOLVE = """#!/bin/bash
set -e
echo alpha > /app/result.txt
echo beta >> /app/result.txt
echo gamma >> /app/result.txt
"""
GOOD_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/result.txt 2>/dev/null)" = "$(printf 'alpha\\nbeta\\ngamma')" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def write_task(root, name, *, solve=GOOD_SOLVE, test=GOOD_TEST, instruction="Write /app/result.txt with the lines "
               "alpha, beta, gamma.\n", verifier_timeout=20.0, dockerfile=None, files=None, extra_toml=""):
    task = root / name
    (task / "solution").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text(instruction)
    (task / "task.toml").write_text(
        f'version = "1.0"\n\n[metadata]\ndifficulty = "easy"\ncategory = "file-ops"\ntags = ["test"]\n\n'
        f"[verifier]\ntimeout_sec = {verifier_timeout}\n\n[agent]\ntimeout_sec = 30.0\n{extra_toml}")
    (task / "solution" / "solve.sh").write_text(solve)
    (task / "tests" / "test.sh").write_text(test)
    if dockerfile is not None:
        (task / "environment").mkdir()
        (task / "environment" / "Dockerfile").write_text(dockerfile)
        for rel, content in (files or {}).items():
            (task / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
            (task / "environment" / rel).write_text(content)
    return task
