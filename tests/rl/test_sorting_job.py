"""The sorting job at test size: it reproduces figures recorded before the code moved, it
trains with an algorithm a test adds, and DAPO's sampling options act in it.

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


def _run(workdir: pathlib.Path, overrides: list[str],
         script: str = "import sys; from rl.cli import main; sys.exit(main())") -> None:
    cmd = [sys.executable, "-c", script,
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


def _from_base(base: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
    workdir.mkdir()
    shutil.copytree(base / "base", workdir / "base")
    return workdir


def _rows(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arm", sorted(RECORDED["arms"]))
def test_the_synchronous_sorting_job_gives_the_recorded_figures(arm, base, tmp_path):
    expected = RECORDED["arms"][arm]
    workdir = base
    if arm != "sao":
        workdir = _from_base(base, tmp_path / arm)
        _run(workdir, expected["overrides"])
    rows = {str(r["step"]): r for r in _rows(workdir)}
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


# A new algorithm: one loss function and one entry of rl/algorithms.py's table, made in the
# job's own process before it starts; `rl.algorithm=reinforce` then trains with it.
REINFORCE = '''
import sys

import jax.numpy as jnp

from rl import algorithms, cli


def reinforce_loss(logp, logp_rollout, advantages, action_mask, token_weights, rl):
    """REINFORCE with the group baseline: -mean_t A_t log pi(a_t), no ratio and no clip."""
    m = action_mask.astype(jnp.float32)
    return -jnp.sum(advantages * logp * m) / jnp.maximum(m.sum(), 1.0), {}


algorithms.ALGORITHMS["reinforce"] = algorithms.Algorithm(reinforce_loss, groups=True)
sys.exit(cli.main(sys.argv[1:]))
'''


def test_an_algorithm_added_as_one_loss_and_one_table_entry_trains(base, tmp_path):
    workdir = _from_base(base, tmp_path / "reinforce")
    _run(workdir, ["rl.algorithm=reinforce", "rl.group_size=4", "rl.steps=3"], script=REINFORCE)
    rows = _rows(workdir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # its loss, not GRPO's: the clipped surrogate is ~0 on-policy, -A log pi is not
    grpo = RECORDED["arms"]["grpo"]["steps"]
    assert all(abs(r["policy_loss"]) > 1e-4 and abs(r["policy_loss"] - grpo[str(r["step"])]["policy_loss"]) > 1e-4
               for r in rows), rows
    assert rows[0]["tasks"] == grpo["1"]["tasks"]  # the same prompts, four rollouts each
    assert "value_loss" not in rows[0]  # no critic: group baselines
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["algorithm"] == "reinforce" and summary["steps"] == 3


def test_dapo_dynamic_sampling_and_overlong_penalty_in_the_job(base, tmp_path):
    """DAPO with groups of 4, `rl.dynamic_sampling` (groups whose rewards are all equal are
    dropped, and others sampled in their place) and `rl.overlong_buffer` equal to the
    answer budget (task.max_new_tokens=10): an answer of n tokens loses n/10."""
    workdir = _from_base(base, tmp_path / "dapo")
    _run(workdir, ["rl.algorithm=dapo", "rl.group_size=4", "rl.steps=3", "rl.dynamic_sampling=True",
                   "rl.overlong_buffer=10"])
    rows = _rows(workdir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # every answer has >= 1 token: the mean penalty is in [-1, -0.1]
        assert -1.0 <= r["reward"] - r["reward_raw"] <= -0.1, r
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["dropped"].get("uniform_group", 0) > 0, summary["dropped"]
    assert summary["rollouts"] == 3 * 16  # every batch full of kept groups
