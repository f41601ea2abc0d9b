"""Harbor tasks run locally in a ``Sandbox``: the task, its environment, its verifier.

``HarborTask`` is what a task directory holds (``envs/harbor/dirs.py`` loads and exports
the directories). Running without Docker: the sandbox's ``/app`` stands for the
container's working directory (the Dockerfile's last ``WORKDIR``; occurrences of that
path in scripts are rewritten to ``/app``), ``/logs/verifier`` is the verifier's log
directory, ``/tests`` and ``/solution`` hold the whole ``tests/`` and ``solution/``
folders (copied in only when they run: tests after the agent has finished, the solution
only for oracle runs). Under the chroot sandbox these are the real paths the commands
see; in the plain fallback they are rewritten to the sandbox's host paths
(``Sandbox.rewrite``) and exported as ``$APP_DIR``, ``$LOGS_DIR``, ``$TEST_DIR``.
The image is built once from the Dockerfile (``envs/image/build.py``): its layer is laid
over every sandbox's root (``task_sandbox``), and ``prepare`` copies its working directory
into ``/app``; scripts run with the install steps that cannot run offline replaced
(``envs/image/installs.py``). A task that cannot be set up so is *unsupported*
(``UnsupportedTask``, with the reason). A
multi-step task (``HarborTask.steps``) runs its steps in turn in one environment.

The verifier cannot be touched or locked out by the agent: it runs as its own user (root
of a user namespace of its own where the kernel allows, ``Sandbox.run(verifier=True)``:
it reads and writes ``/app`` whatever modes the agent left there), ``/tests`` and
``/logs/verifier`` are its own and are made afresh with the tests copied in, it gets a
fresh ``/tmp`` (also ``HOME``) of its own, on a disk the agent cannot fill; the tests'
PATH holds no directory the agent could write; pytest loads only the plugins of the
packages the task installs (as in its image); every ``python`` they start through the
sandbox's tools skips user site-packages and finds an empty ``sitecustomize`` /
``usercustomize`` before any the agent planted (``envs/image/host_tools.py``); the reward is
read only from the directory made for the verifier, and only from a regular file.

Reward: ``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (``{"reward": x}``, or
the mean of its numeric values); a test script that writes neither is scored by its exit
status (0 -> 1.0, else 0.0). A verifier that is killed (timeout, output or memory limit),
or a reward file that is not a regular file (a symlink) scores 0.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import re
import shlex
import stat
from typing import Mapping

from envs.base import Task
from envs.image import host_tools, installs
from envs.sandbox.sandbox import RunResult, Sandbox

_AGENT_WRITABLE = ("/app", "/tmp", "/logs", "/solution")


class UnsupportedTask(Exception):
    """The task's environment cannot be set up locally; the message says why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HarborTask(Task):
    """A sandboxed task. ``files``: the working directory's initial contents (paths
    relative to it); ``tmp_files``: what the image puts under ``/tmp``; ``solution``:
    ``solve.sh`` (install steps resolved);
    ``solution_files``: the rest of ``solution/`` (``solve.py``, data ...), copied in beside
    it; ``tests``: the tests/ directory; ``modes``: permission bits of ``files``'s
    entries where they matter (an executable the image built), and of its directories (a
    path ending in "/"; an empty one is only here); ``layer``: the image's layer
    (``envs/image/build.py``), laid read-only over the sandbox's root; ``user``: the user
    agent commands run as in the image (its ``USER``, ``[agent] user``), whose name the
    sandbox's uid takes; ``partials``:
    half-done solutions (each must score 0);
    ``installs``: how each install step was resolved; ``notes``: what the emulation left out;
    ``storage_bytes``: the task's ``[environment] storage_mb``: the largest file it may write and the
    least disk it gets.

    A multi-step task (Harbor's ``[[steps]]``) has ``steps``: one task each (its own
    instruction, tests layered over the task's, solution, timeouts and ``min_reward``: a
    reward below it ends the run), run in turn in the one environment this task sets up;
    its reward is the ``step_reward`` ("mean" over all steps, a step not reached counting
    0, or "final": the last step's) of theirs (``trial_reward``)."""

    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    tmp_files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    solution: str | None = None
    solution_files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    tests: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    test_command: str = "bash /tests/test.sh"
    partials: tuple[str, ...] = ()
    modes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    layer: str | None = None
    user: str = ""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    agent_timeout: float = 120.0
    verifier_timeout: float = 120.0
    workdir: str = "/app"
    unsupported: str | None = None
    source: str | None = None
    installs: tuple[Mapping, ...] = ()
    notes: tuple[str, ...] = ()
    steps: tuple["HarborTask", ...] = ()
    step_reward: str = "mean"
    min_reward: float | None = None
    storage_bytes: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.step_reward not in ("mean", "final"):
            raise ValueError(f"HarborTask.step_reward must be 'mean' or 'final', got {self.step_reward!r}")

    def replace(self, **changes) -> "HarborTask":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A verifier run: the reward, where it came from ("reward.txt" | "reward.json" |
    "exit status" | "killed" | "unreadable reward" | "reward file is not a regular file"), and
    the test command's result."""

    reward: float
    source: str
    result: RunResult

    def detail(self, tail: int = 600) -> str:
        return f"reward {self.reward} from {self.source} {self.result.summary()}: ...{self.result.output[-tail:]}"


def trial_reward(task: HarborTask, rewards: list[float]) -> float:
    """A multi-step task's reward from its steps' (those run, in order; see ``HarborTask``)."""
    if task.step_reward == "final":
        return rewards[-1] if len(rewards) == len(task.steps) else 0.0
    return sum(rewards) / len(task.steps)


def stops_after(step: HarborTask, reward: float) -> bool:
    """Whether a multi-step run ends after ``step`` scored ``reward`` (below its ``min_reward``)."""
    return step.min_reward is not None and reward < step.min_reward


# ----- running ---------------------------------------------------------------------------------
def _map(text: str | bytes, task: HarborTask, sandbox: Sandbox, script: str | None = None) -> str | bytes:
    """``text`` as the sandbox runs it: the task's working directory written as ``/app``,
    paths rewritten for the plain fallback and, for a shell ``script`` (its name), the
    install steps that cannot run offline replaced (``envs/image/installs.py``)."""
    if isinstance(text, bytes):
        try:
            return _map(text.decode(), task, sandbox, script).encode()
        except UnicodeDecodeError:
            return text
    if script is not None:
        try:
            text = installs.scan(text, script).script
        except ValueError:
            pass  # not shell syntax glmjax can read: run as written, bash will say what is wrong
    if task.workdir != "/app":
        text = re.sub(r"(?<![\w./-])" + re.escape(task.workdir.rstrip("/")) + r"(?=[/\s\"'`;:)|&<>]|$)", "/app", text)
    return sandbox.rewrite(text)


def task_limits(task: HarborTask, limits):
    """``limits`` with the task's own storage as the file-size cap and the disk's size,
    where it declares more."""
    if task.storage_bytes:
        return limits.replace(file_bytes=max(limits.file_bytes, task.storage_bytes),
                              disk_bytes=max(limits.disk_bytes, task.storage_bytes))
    return limits


@functools.lru_cache(maxsize=1024)
def _pytest_plugins(packages: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(host_tools.pytest_plugins(packages))  # metadata lookups: once per task, not per command


def task_env(sandbox: Sandbox, task: HarborTask, *, verifier: bool = False) -> dict[str, str]:
    """The task's variables for a command: ``$PATH`` expanded against the sandbox's PATH;
    for the verifier, PATH without directories the agent could write, and no user site."""
    path = sandbox.env()["PATH"]
    env = {k: re.sub(r"\$\{PATH\}|\$PATH\b", path, _map(v, task, sandbox)) for k, v in task.env.items()}
    # pytest loads the plugins of what the task installs, as in its image, not every plugin of the host's
    env.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins = _pytest_plugins(tuple(p for i in task.installs for p in i.get("packages", ())))
    if plugins:
        env.setdefault("PYTEST_PLUGINS", ",".join(plugins))
    if verifier:
        writable = tuple(sandbox.path(d) for d in _AGENT_WRITABLE)
        entries = env.get("PATH", path).split(":")
        env["PATH"] = ":".join(e for e in entries if e and os.path.isabs(e) and not any(
            e == w or e.startswith(w + "/") for w in writable)) or path
        env["PYTHONNOUSERSITE"] = "1"
        # a python started by its own path (/usr/bin/python3) loads the guard too (envs/image/host_tools.py)
        env["PYTHONPATH"] = ":".join([f"{sandbox.tools}/guard", *filter(None, [env.get("PYTHONPATH")])])
    return env


def task_sandbox(task: HarborTask, limits, **kwargs) -> Sandbox:
    """A fresh sandbox for ``task``: its limits (``task_limits``), its source hidden, its
    image's layer laid over the root, its user's name."""
    return Sandbox(limits=task_limits(task, limits), hide=(task.source,) if task.source else (), layer=task.layer,
                   user=task.user, **kwargs)


def prepare(sandbox: Sandbox, task: HarborTask) -> None:
    """Set up the task's environment in a fresh sandbox (its image's working directory and
    ``/tmp``; the rest of the image is its layer); ``UnsupportedTask`` if it cannot be."""
    if task.unsupported:
        raise UnsupportedTask(task.unsupported)
    for rel in sorted(p for p in task.modes if p.endswith("/")):
        sandbox.make_dir(f"/app/{rel.rstrip('/')}", task.modes[rel])
    for rel, data in task.files.items():
        sandbox.write_file(f"/app/{rel}", _map(data, task, sandbox), task.modes.get(rel))
    for rel, data in task.tmp_files.items():
        sandbox.write_file(f"/tmp/{rel}", _map(data, task, sandbox))


def run_script(sandbox: Sandbox, task: HarborTask, script: str) -> RunResult:
    """Run ``script`` as the solution would run (``bash /solution/solve.sh`` in ``/app``),
    with the rest of the task's ``solution/`` beside it."""
    sandbox.reset_dir("/solution")
    for rel, data in task.solution_files.items():
        sandbox.write_file(f"/solution/{rel}", _map(data, task, sandbox, rel if rel.endswith(".sh") else None))
    sandbox.write_file("/solution/solve.sh", _map(script, task, sandbox, "solve.sh"))
    limits = sandbox.limits.replace(wall_seconds=min(sandbox.limits.wall_seconds, task.agent_timeout))
    return sandbox.run(f"bash {shlex.quote(sandbox.path('/solution/solve.sh'))}", limits=limits,
                       env=task_env(sandbox, task))


def run_tests(sandbox: Sandbox, task: HarborTask) -> Verdict:
    """A fresh ``/tmp`` and ``/logs/verifier``, the tests copied in, the test command run
    with the verifier's environment, the reward read from the verifier's own directory."""
    for virtual in ("/tests", "/logs/verifier"):
        sandbox.reset_dir(virtual)
    sandbox.reset_verifier_tmp()
    for rel, data in task.tests.items():
        sandbox.write_file(f"/tests/{rel}", _map(data, task, sandbox, rel if rel.endswith(".sh") else None))
    limits = sandbox.limits.replace(wall_seconds=task.verifier_timeout)
    result = sandbox.run(_map(task.test_command, task, sandbox), limits=limits,
                         env=task_env(sandbox, task, verifier=True), verifier=True)
    if result.killed:
        return Verdict(0.0, "killed", result)
    try:
        text = _verifier_file(sandbox, "reward.txt", 4096)
        blob = None if text is not None else _verifier_file(sandbox, "reward.json", 1 << 16)
    except _Forged as err:
        return Verdict(0.0, str(err), result)
    if text is not None:
        try:
            return Verdict(float(text.decode().strip()), "reward.txt", result)
        except ValueError:
            return Verdict(0.0, "unreadable reward", result)
    if blob is not None:
        try:
            data = json.loads(blob)
            if isinstance(data, dict) and "reward" not in data:
                values = [float(v) for v in data.values() if isinstance(v, (int, float))]
                data = sum(values) / len(values) if values else None
            value = float(data["reward"] if isinstance(data, dict) else data)
            return Verdict(value, "reward.json", result)
        except (ValueError, TypeError, KeyError):
            return Verdict(0.0, "unreadable reward", result)
    return Verdict(1.0 if result.returncode == 0 else 0.0, "exit status", result)


class _Forged(Exception):
    """The reward is not a regular file in the verifier's directory."""


def _verifier_file(sandbox: Sandbox, name: str, limit: int) -> bytes | None:
    """``name`` from the verifier directory made for this run (which the sandbox's user
    cannot replace: its parent is root's), never through a symlink; None when missing."""
    try:
        dir_fd = os.open(sandbox.host_path("/logs/verifier"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        raise _Forged("verifier directory is not a directory") from None
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise _Forged("reward file is not a regular file") from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise _Forged("reward file is not a regular file")
            return f.read(limit)
    finally:
        os.close(dir_fd)
