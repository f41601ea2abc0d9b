"""Two local processes of 4 CPU devices each (gloo collectives) run one sharded train step
and agree with one process of 8 devices; the updated model saved as an HF checkpoint and
loaded back on expert=4 x tensor=2 has the same parameters, each process having read only
its own experts."""

import json
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import jax

WORKER = pathlib.Path(__file__).resolve().parents[1] / "multihost_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(num_processes: int, out: pathlib.Path) -> dict:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(num_processes), port, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(num_processes)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        finally:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return json.loads(out.read_text())


def test_two_processes_match_one(tmp_path):
    two = _run(2, tmp_path / "two.json")
    one = _run(1, tmp_path / "one.json")
    assert two["process_count"] == 2 and one["process_count"] == 1
    for key in ("loss", "grad_norm", "checksum", "next_loss", "loaded_checksum"):
        assert abs(two[key] - one[key]) <= 1e-5 * max(1.0, abs(one[key])), (key, two[key], one[key])
    assert two["next_loss"] < two["loss"]
    assert abs(two["loaded_checksum"] - two["checksum"]) <= 1e-5 * two["checksum"]
    assert two["experts_read"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert one["experts_read"] == [list(range(8))]


# The SAO job over two processes ------------------------------------------------------------
MESH = ["--config.mesh.fsdp=4", "--config.mesh.expert=2"]


def _job(workdir, num_processes: int, *extra, code: str | None = None) -> list[subprocess.CompletedProcess]:
    """`glmjax-train` on the tiny main job (tests/rl/test_trainer.py's SMALL size, two layers,
    3 steps) over 8 CPU devices: one process of 8, or `num_processes` of 8 / num_processes
    each talking gloo through a coordinator on this machine (`code`: the program each runs
    in place of the console script's, with the same arguments). Every launch compiles: a
    second process cannot read the first one's compile cache (XLA:CPU's compile options
    name the process)."""
    from tests.rl.test_trainer import REPO, _cmd, _env

    port, env = str(_free_port()), _env()
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                + [f"--xla_force_host_platform_device_count={8 // num_processes}"])
    cmds = [_cmd(workdir, *MESH, "--config.rl.steps=3", *extra, f"--config.distributed.num_processes={num_processes}",
                 f"--config.distributed.process_id={i}", f"--config.distributed.coordinator=127.0.0.1:{port}")
            for i in range(num_processes)]
    if code is not None:
        cmds = [[cmd[0], "-c", code, *cmd[3:]] for cmd in cmds]
    # output to files: a process blocked on a full pipe would hold the others in a collective
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in cmds]
    procs = [subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=err, text=True)
             for cmd, (out, err) in zip(cmds, logs)]
    deadline, done = time.time() + 600, []
    for p, (out, err) in zip(procs, logs):
        try:
            p.wait(timeout=max(deadline - time.time(), 1))  # a hang fails here
        finally:
            for q in procs:
                if q.returncode is None and time.time() > deadline:
                    q.kill()
        out.seek(0), err.seek(0)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
    for d in done:
        assert d.returncode == 0, d.stderr[-3000:]
    return done


def _checksum(workdir, step: int) -> float:
    """Sum of squares of the policy's parameters in the job's orbax checkpoint of `step`."""
    import numpy as np
    import orbax.checkpoint as ocp

    path, reader = workdir / "checkpoints" / str(step) / "arrays", ocp.PyTreeCheckpointer()
    tree = reader.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    arrays = reader.restore(path, restore_args=as_numpy)  # on the host: the devices that wrote it are gone
    return float(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(arrays["policy"])))


def _base(workdir) -> None:
    """The main job's own base model (configs/sao_tiny.py's SFT on two layers, which solves
    some held-out tasks, so that rewards, advantages and updates are not all zero), trained
    on one device in this process and cached in workdir/base."""
    from glmjax import presets
    from rl import base_model
    from rl.config import JobConfig
    from tests.rl.test_trainer import REPO, TWO_LAYERS

    overrides = ["base.demonstrations=1000", "base.steps=150", *TWO_LAYERS]  # held out: 25% of 8
    cfg = JobConfig.from_config(presets.load_config(REPO / "configs" / "sao_tiny.py", overrides))
    base_model.build_base(cfg, str(workdir))


def test_two_processes_run_the_sao_job_as_one(tmp_path):
    """Synchronous SAO (rl.eta=0) on fsdp=4 x expert=2 as 2 processes of 4 devices trains on
    the rollouts one process of 8 devices makes: the same tasks, rewards and losses step by
    step and the same parameters in the last checkpoint, which both processes wrote; with an
    engine per process, and with one engine over all 8 devices that both processes step in
    lockstep (rl.engine_span=job). Each process learns from its own rollouts, in the 4 of
    the 8 learner rows its devices hold. Only process 0 prints and logs. Resumed from it by
    2 processes, asynchronously (rl.eta=1) with the engine over both, the job runs 2 more
    steps and ends."""
    from tests.rl.test_trainer import _metrics, _same_steps

    one, two, span = tmp_path / "one", tmp_path / "two", tmp_path / "span"
    _base(one)
    for other in (two, span):  # the same starting point
        subprocess.run(["cp", "-r", str(one), str(other)], check=True)
    _job(one, 1)
    expected = _metrics(one)
    assert sorted(expected) == [1, 2, 3]
    assert any(r["reward"] > 0 for r in expected.values()), expected  # something to learn from
    engines = {two: "one engine per process on its 4 devices",
               span: "one engine over all 8 devices, every process stepping it in lockstep"}
    for workdir, engine in engines.items():
        first, second = _job(workdir, 2, f"--config.rl.engine_span={'job' if workdir == span else 'process'}")
        assert f"over 2 processes; {engine}" in first.stdout, first.stdout[-2000:]
        assert "pass rate" in first.stdout and "pass rate" not in second.stdout, second.stdout[-2000:]
        assert len((workdir / "metrics.jsonl").read_text().splitlines()) == 3  # one writer
        got = _metrics(workdir)
        assert sorted(got) == [1, 2, 3]
        _same_steps(got, expected, expected, rtol=1e-4)
        a, b = _checksum(one, 3), _checksum(workdir, 3)
        assert abs(a - b) <= 1e-5 * a, (a, b)
        summary = json.loads((workdir / "summary.json").read_text())
        assert summary["processes"] == 2 and summary["steps"] == 3 and summary["rollouts"] == 24
        assert summary["learner_rows_per_process"] == 4 and summary["learner_rows"] == 8
        # each step sends the other process a summary of 4 rollouts, not the rollouts
        assert 0 < summary["rollout_bytes_sent_per_step"] < 4 * 200, summary["rollout_bytes_sent_per_step"]

    first, _ = _job(two, 2, "--config.rl.steps=5", "--config.rl.eta=1", "--config.rl.engine_span=job")
    assert "resumed from step 3" in first.stdout, first.stdout[-2000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["rollouts"] == 40 and summary["resumed_from_step"] == 3
    assert sorted(_metrics(two)) == [1, 2, 3, 4, 5]
