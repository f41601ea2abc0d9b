"""rl/checkpoint.py: a checkpoint that does not read is skipped, set aside and named; the
one before it is restored."""

import logging
import os
import pathlib
import types

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rl import rollout as ro
from rl.checkpoint import LoopCheckpointer, UnreadableCheckpoints
from rl.tasks import TaskStream


def _kernel(value: float) -> np.ndarray:
    """Weights that differ by step and do not compress away (their file is the largest)."""
    return np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32) + value


def _loop(value: float):
    """A policy with weights `_kernel(value)`, its optimizer, and the loop state around it."""
    policy = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    policy.kernel.value = jnp.asarray(_kernel(value))
    learner = types.SimpleNamespace(actor_opt=nnx.Optimizer(policy, optax.adam(1e-3), wrt=nnx.Param), steps=int(value),
                                    skipped=0)
    return dict(policy=policy, critic=None, learner=learner, stream=TaskStream(list(range(10)), seed=0),
                admission=ro.Admission(4, 1, 4))


def _save(directory, steps):
    ckpt = LoopCheckpointer(directory)
    for step in steps:
        loop = _loop(step)
        for _ in range(step):
            next(loop["stream"])
        ckpt.save(step, **loop, version=step, rollouts=10 * step)
    ckpt.wait()


def _truncate(path: pathlib.Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _largest_array_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((step_dir / "arrays" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("part, reason", [("arrays", "2/arrays: ValueError: OUT_OF_RANGE"),
                                          ("metadata", "2/meta/metadata: JSONDecodeError")])
def test_a_truncated_newest_checkpoint_resumes_from_the_one_before(tmp_path, caplog, part, reason):
    _save(tmp_path, [1, 2])
    _truncate(_largest_array_file(tmp_path / "2") if part == "arrays" else tmp_path / "2" / "meta" / "metadata")
    loop = _loop(0.0)
    with caplog.at_level(logging.WARNING, logger="rl.checkpoint"):
        meta = LoopCheckpointer(tmp_path).restore(**loop)
    assert meta["step"] == 1 and meta["rollouts"] == 10 and loop["learner"].steps == 1
    np.testing.assert_array_equal(np.asarray(loop["policy"].kernel.value), _kernel(1.0))
    assert next(loop["stream"]) == _advanced(1)  # the stream continues where step 1 left it
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("checkpoint step 2 does not read (") and reason in line, line
    assert f"resuming from step 1 instead; step 2 is moved to {tmp_path / '2.corrupt'}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.corrupt"]

    _save(tmp_path, [2])  # the step number is free again; the bad copy stays aside
    assert LoopCheckpointer(tmp_path).restore(**_loop(0.0))["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "2.corrupt"]


def _advanced(n: int):
    stream = TaskStream(list(range(10)), seed=0)
    for _ in range(n):
        next(stream)
    return next(stream)


def test_no_checkpoint_that_reads_is_an_error_that_moves_nothing(tmp_path):
    _save(tmp_path, [1, 2])
    _truncate(tmp_path / "2" / "meta" / "metadata")
    _truncate(_largest_array_file(tmp_path / "1"))
    with pytest.raises(UnreadableCheckpoints, match=r"reads: step 2: 2/meta/metadata: JSONDecodeError.*; "
                                                    r"step 1: 1/arrays: ValueError"):
        LoopCheckpointer(tmp_path).restore(**_loop(0.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_an_empty_directory_restores_nothing(tmp_path):
    assert LoopCheckpointer(tmp_path / "none").restore(**_loop(0.0)) is None


def test_a_read_that_fails_on_one_process_makes_every_process_resume_from_the_step_before(tmp_path):
    """Two processes (tests/rl/restore_worker.py) save steps 1 and 2 of a policy split over
    both; process 1 truncates its own shard file of step 2, which process 0 never reads.
    Both restore step 1, each its own rows of step 1's weights, inside the timeout (before,
    process 1 skipped to step 1 alone and waited in orbax's restore barrier forever)."""
    import json
    import subprocess
    import sys

    from tests.glmjax.test_multihost import _free_port

    worker, port = pathlib.Path(__file__).with_name("restore_worker.py"), str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), port, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])  # a hang fails here
        finally:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert "process 1: 2/arrays: ValueError: OUT_OF_RANGE" in logs[0], logs[0][-3000:]
    expected = _kernel(1.0)
    for i in range(2):
        restored = json.loads((tmp_path / f"restored_{i}.json").read_text())
        assert restored["step"] == 1
        rows = [int(k.split(",")[0].removeprefix("(slice(")) for k in restored["shards"]]
        assert rows == [32 * i, 32 * i + 16], rows
        for start, mean in zip(rows, restored["shards"].values()):
            np.testing.assert_allclose(mean, expected[start:start + 16].mean(), rtol=1e-5)
    assert (tmp_path / "checkpoints" / "2.corrupt").is_dir() and not (tmp_path / "checkpoints" / "2").exists()
