"""The sorting job in synchronous mode reproduces figures recorded before the code moved.

tests/rl/figures/sorting_sync.json holds, for SAO and for GRPO, the per-step rewards,
losses, clip fractions, entropies and task ids of configs/sao_tiny.py at test size with
`rl.eta=0`, and the held-out pass rates before and after: the job as it ran before its
files were rearranged. Moving code must not move these numbers; a change that does alter
the numerics re-records the file and says why in its `about`.

The job runs under the XLA flags it was recorded with (those of tests/conftest.py: the
compiler's options change the last bits, and sampled tokens with them). Between two runs of the same code the losses differ in the 7th significant digit (XLA:CPU's
threaded reductions), hence 1e-6 against max(1, |x|) and not equality.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
RECORDED = json.loads((pathlib.Path(__file__).parent / "figures" / "sorting_sync.json").read_text())
NUMBERS = ("reward", "policy_loss", "value_loss", "clip_fraction", "kl_rollout", "entropy")


def _run(workdir: pathlib.Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-c", "import sys; from rl.cli import main; sys.exit(main())",
           "--config", str(REPO / "configs" / "sao_tiny.py"), "--workdir", str(workdir),
           *(f"--config.{o}" for o in RECORDED["overrides"] + overrides)]
    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "XLA_FLAGS": RECORDED["xla_flags"]}
    done = subprocess.run(cmd, env=dict(os.environ, **env), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> pathlib.Path:
    """The SAO arm's workdir: its cached base model is every arm's (the same seed and data)."""
    workdir = tmp_path_factory.mktemp("sao")
    _run(workdir, RECORDED["arms"]["sao"]["overrides"])
    return workdir


@pytest.mark.parametrize("arm", sorted(RECORDED["arms"]))
def test_the_synchronous_sorting_job_gives_the_recorded_figures(arm, base, tmp_path):
    expected = RECORDED["arms"][arm]
    workdir = base
    if arm != "sao":
        workdir = tmp_path / arm
        workdir.mkdir()
        shutil.copytree(base / "base", workdir / "base")
        _run(workdir, expected["overrides"])
    rows = {str(r["step"]): r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == sorted(expected["steps"])
    for step, want in expected["steps"].items():
        got = rows[step]
        assert got["tasks"] == want["tasks"] and got["version"] == want["version"], step
        for key in NUMBERS:
            x, y = got.get(key), want[key]
            if y is None:
                assert x is None, (arm, step, key, x)
            else:
                assert x is not None and abs(x - y) <= 1e-6 * max(1.0, abs(y)), (arm, step, key, x, y)
    summary = json.loads((workdir / "summary.json").read_text())
    for key in ("base_pass_rate", "final_pass_rate", "rollouts"):
        assert summary[key] == expected[key], (arm, key, summary[key], expected[key])
