"""Environment workers on Ray (envs/workers/ray_backend.py), on a two-node Ray cluster of
this machine: the agentic job's episodes, through the collector as the trainer runs them,
get the rewards and token rows the in-process backend gives; a worker killed mid-episode
drops exactly its episodes ("env_worker_lost") and the others finish; a task read from
a directory runs on a worker after the directory is gone, and a worker whose node lacks
the task's image layer gets a copy of it.

The cluster is bound to loopback: its nodes and this driver advertise 127.0.0.2 (Ray
rewrites 127.0.0.1 to the machine's interface address), so no traffic goes to another
address; it takes a token of its own (no other process attaches to it, and nothing is
read from or written to ~/.ray). The test starts both nodes (`ray start --block`, each in
a session of its own) and stops them by their process ids at the end."""

import dataclasses
import importlib.util
import os
import pathlib
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from envs import families
from envs.harbor import dirs
from envs.workers import ray_backend
from glmjax.chat import ByteChat
from glmjax.presets import load_config
from rl import rollout as ro
from rl import tasks as rl_tasks
from rl.collector import Collector
from rl.config import JobConfig
from rl.engine.driver import Result

REPO = pathlib.Path(__file__).resolve().parents[3]
CHAT = ByteChat()
N = 6  # episodes at once: three on each worker
WAIT = "<bash>sleep 1</bash>"  # every episode's first turn: the kill lands while its command runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # Ray's servers listen on every interface: the port must be free on all
        return s.getsockname()[1]


def _start(args, env) -> subprocess.Popen:
    return subprocess.Popen(["ray", "start", *args, f"--node-ip-address={ray_backend.LOOPBACK}", "--num-cpus=1",
                             "--disable-usage-stats", "--block"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node of one CPU each, on loopback; yields the head's address."""
    if importlib.util.find_spec("ray") is None or shutil.which("ray") is None:
        pytest.skip("ray is not installed (setup.py's test extra)")
    temp = tempfile.mkdtemp(prefix="glmjax-ray-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    env = dict(os.environ, **auth)
    port = _free_port()
    address = f"{ray_backend.LOOPBACK}:{port}"
    nodes = [_start(["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false"], env)]
    patch = pytest.MonkeyPatch()
    try:
        for key, value in auth.items():  # this process joins as a driver with the same token
            patch.setenv(key, value)
        import ray  # after the token is set: Ray reads its auth mode once, at import

        _await(lambda: _reachable(ray_backend.LOOPBACK, port), "the head's GCS", nodes)
        nodes.append(_start([f"--address={address}"], env))
        yield ray, address
    finally:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        patch.undo()
        for p in nodes:  # `ray start --block` stops the node's processes when told to stop
            p.send_signal(signal.SIGTERM)
        for p in nodes:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session it started: what is left of its processes
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _await(ready, what: str, nodes=(), seconds: float = 30.0) -> None:
    deadline = time.time() + seconds
    while not ready():
        dead = [p.args for p in nodes if p.poll() is not None]
        if dead or time.time() > deadline:
            raise AssertionError(f"{what} not up in {seconds} s (exited: {dead})")
        time.sleep(0.1)


def _job(**env) -> JobConfig:
    cfg = load_config(REPO / "configs" / "sao_agent_tiny.py")
    cfg.task.max_len = 208  # the waiting turn and a wrong answer's, beside the demonstration
    cfg.env.update(turn_tokens=64, workers=2 * N, **env)
    return JobConfig.from_config(cfg)


@pytest.fixture(scope="module")
def ray_job(cluster):
    """The agentic job with env.backend="ray" on the cluster, its pool of two workers, and
    the cluster's live node ids."""
    ray, address = cluster
    job = _job(backend="ray", ray_address=address, ray_workers=2, ray_worker_cpus=1.0, ray_worker_slots=N)
    pool = rl_tasks.env_workers(job.env)
    _await(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, "the second node")
    yield job, pool, {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    rl_tasks.close_env_workers()


def _script(task) -> list[str]:
    """The model's turns: a waiting command, then the demonstration, or for about half the
    tasks (by id) a wrong answer, so that rewards differ."""
    if int(task.id[-1], 16) % 2:
        return [WAIT, "<bash>echo wrong >ans</bash><submit/>"]
    return [WAIT, *task.metadata["demonstration"]]


class _Done:
    def __init__(self, result):
        self._result = result

    def done(self):
        return True

    def result(self):
        return self._result

    def cancel(self):
        pass


class ScriptedModel:
    """The engine's driver, answering each session's turns from its script."""

    def __init__(self):
        self.scripts = {}

    def submit(self, request):
        text = next(self.scripts[request.session_id], "<submit/>")
        tokens = (CHAT.encode_text(text) + [CHAT.tool_call_id])[:request.max_new_tokens]
        return _Done(Result(tokens, [0.0] * len(tokens), [0] * len(tokens), "stop"))


def _run(job, tasks, batch: int, during=None, seconds: float = 40.0):
    """`batch` episodes of `tasks` (in order) through the collector; `during(episodes)` is
    called on every poll. Returns the collector, once a batch of `batch` has finished, and
    the episodes."""
    model, factory = ScriptedModel(), rl_tasks.RolloutFactory(job, job.task.max_len - 1)
    episodes = []

    def make(task, rid):
        model.scripts[f"rollout-{rid}"] = iter(_script(task))
        episodes.append(factory(task, rid))
        return episodes[-1]

    collector = Collector(model, ro.Admission(batch, eta=0, max_concurrent=batch), make, iter(tasks),
                          workers=job.env.workers, env_timeout=30.0)
    deadline = time.time() + seconds
    try:
        while collector.take(batch) is None:
            assert time.time() < deadline, f"no batch in {seconds} s: dropped {dict(collector.dropped)}"
            collector.poll(0)
            if during:
                during(episodes)
            time.sleep(0.005)
    finally:
        collector.close()
    return collector, episodes


def test_episodes_run_on_both_nodes_as_in_process_and_a_dead_worker_drops_only_its_own(ray_job):
    job, pool, node_ids = ray_job
    tasks = families.make_tasks("lookup", 2 * N, seed=0)
    reference, _ = _run(_job(), tasks, 2 * N)
    expected = {t.id: (r.reward, r.row) for t, r in reference.drain_finished()}
    assert sorted(expected) == sorted(t.id for t in tasks) and not reference.dropped
    assert {reward for reward, _ in expected.values()} == {0.0, 1.0}  # both kinds of episode

    killed = {}

    def kill_when_all_started(episodes):
        if not killed and len(episodes) == N and all(e.env.where for e in episodes):  # every sandbox made
            victim = pool.workers()[0]
            killed.update(victim)
            os.kill(victim["pid"], signal.SIGKILL)

    collector, episodes = _run(job, tasks, N, during=kill_when_all_started)
    assert killed["episodes"] == N // 2
    assert dict(collector.dropped) == {"env_worker_lost": killed["episodes"]}
    finished = collector.drain_finished()
    assert len(finished) == N  # the others, and as many new episodes in the dropped ones' place
    for task, r in finished:
        assert (r.reward, r.row) == expected[task.id], task.id
    on_the_dead_worker = [e for e in episodes if e.env.where["pid"] == killed["pid"]]
    assert [e for e in episodes if e.reward is None] == on_the_dead_worker and len(on_the_dead_worker) == N // 2
    nodes = {e.env.where["node"] for e in episodes}
    assert nodes == node_ids and len(nodes) == 2
    assert pool.lost == 1 and killed["pid"] not in {w["pid"] for w in pool.workers()}


def test_a_task_travels_by_value_to_its_worker(ray_job, tmp_path):
    """A Harbor task read from a directory that is gone before its episode starts: the
    worker has the task's files, tests and solution from the task itself."""
    job, _, node_ids = ray_job
    shutil.copytree(REPO / "tests" / "harbor_tasks" / "tb-dedupe-log", tmp_path / "tb-dedupe-log")
    (task,) = dirs.load_tasks([str(tmp_path)])
    shutil.rmtree(tmp_path / "tb-dedupe-log")
    env = rl_tasks.make_env(job, "bash")
    episode = rl_tasks.oracle_episode(task, env, CHAT, window=4096)  # raises unless rewarded
    assert episode.reward == 1.0 and env.where["node"] in node_ids
    assert env.transcript.reward == 1.0  # the ended episode's transcript, brought back with its last step


def _layer(root: pathlib.Path) -> pathlib.Path:
    """An image layer as a build leaves it: a file with its mode, a link, an empty directory,
    and overlay's marks of what the build deleted (a 0:0 device, an opaque directory)."""
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "tool").write_text("#!/bin/sh\necho tool\n")
    (root / "usr" / "bin" / "tool").chmod(0o750)
    (root / "usr" / "bin" / "alias").symlink_to("tool")
    (root / "empty").mkdir()
    (root / "opaque").mkdir()
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")
    os.mknod(root / "deleted", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    return root


def _same_layer(a: pathlib.Path, b: pathlib.Path) -> None:
    for path in a.rglob("*"):
        other = b / path.relative_to(a)
        sa, sb = path.lstat(), other.lstat()
        assert (sa.st_mode, sa.st_uid, sa.st_rdev) == (sb.st_mode, sb.st_uid, sb.st_rdev), path
        if path.is_symlink():
            assert os.readlink(path) == os.readlink(other)
        elif path.is_file():
            assert path.read_bytes() == other.read_bytes()
    assert os.getxattr(b / "opaque", "trusted.overlay.opaque") == b"y"
    assert sorted(p.relative_to(a) for p in a.rglob("*")) == sorted(p.relative_to(b) for p in b.rglob("*"))


@dataclasses.dataclass(frozen=True)
class _Task:  # what a worker reads of a task's image: its layer's path
    layer: str | None

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@pytest.mark.skipif(os.geteuid() != 0, reason="overlay's marks (devices, trusted xattrs) are made by root")
def test_a_worker_uses_the_trainers_layer_where_its_node_has_it_and_else_a_copy_sent_once(tmp_path, monkeypatch):
    """A node that shares the trainer's image cache uses its layer in place; one that does
    not asks for it (None), gets `pack_layer`'s tar, and keeps its copy for later episodes."""
    monkeypatch.setattr(ray_backend, "LAYERS", str(tmp_path / "node" / "layers"))
    layer = _layer(tmp_path / "images" / "a1b2" / "layer")
    worker, task = ray_backend.Worker(), _Task(str(layer))
    assert worker.local(task, None) == task
    data = ray_backend.pack_layer(str(layer))
    shutil.move(tmp_path / "images", tmp_path / "trainer-only")  # the node does not have the trainer's path
    assert worker.local(task, None) is None
    copy = worker.local(task, data).layer
    assert copy.startswith(ray_backend.LAYERS + os.sep)
    _same_layer(tmp_path / "trainer-only" / "a1b2" / "layer", pathlib.Path(copy))
    assert worker.local(task, None).layer == copy  # unpacked once
    assert worker.local(_Task(None), None) == _Task(None)


def test_the_env_backend_is_read_from_the_job_config():
    assert _job().env.backend == "thread"
    with pytest.raises(ValueError, match=r"env.backend='slurm' is unknown: expected one of \['ray', 'thread'\]"):
        _job(backend="slurm")
    with pytest.raises(ValueError, match="env.ray_workers=0 is invalid"):
        _job(backend="ray", ray_workers=0)

