"""Harbor / Terminal-Bench task directories: load, run locally in a ``Sandbox``, export.

Formats read (``load_task``):

    Harbor                              Terminal-Bench (older)
    instruction.md                      task.yaml (instruction, difficulty, max_*_timeout_sec)
    task.toml ([metadata] [agent]       Dockerfile, docker-compose.yaml (one service)
      [verifier] [environment])         solution.sh (or solution.yaml: a list of commands)
    environment/Dockerfile              run-tests.sh, tests/...
    solution/ (solve.sh, solve.py, ..., partial-*.sh)
    tests/ (test.sh, test_outputs.py, ...)

Running without Docker. The sandbox's ``/app`` stands for the container's working
directory (the Dockerfile's last ``WORKDIR``; occurrences of that path in scripts are
rewritten to ``/app``), ``/logs/verifier`` is the verifier's log directory, ``/tests`` and
``/solution`` hold the whole ``tests/`` and ``solution/`` folders (copied in only when they
run: tests after the agent has finished, the solution only for oracle runs). Under the
chroot sandbox these are the real paths the commands see; in the plain fallback they are
rewritten to the sandbox's host paths (``Sandbox.rewrite``) and exported as ``$APP_DIR``,
``$LOGS_DIR``, ``$TEST_DIR``. The Dockerfile is emulated (``envs/dockerfile.py``); install
steps in it, in the tests' and in the solution's scripts are resolved against the host
(``envs/installs.py``): what the host has satisfies them and is noted in ``installs``;
what it lacks makes the task *unsupported* (reported with the reason, never silently
passed), as do a multi-service compose file, a prebuilt image and a ``RUN`` that fails
locally. A multi-step task (``[[steps]]``, each step in ``steps/<name>/`` with its own
``instruction.md``, ``tests/`` over the task's and ``solution/``) runs its steps in turn
in one environment (``HarborTask.steps``). A malformed ``task.toml`` raises
``HarborFormatError`` naming the file, the field and the type it must have.

The verifier cannot be touched by the agent: before the tests run, ``/tmp`` (also
``HOME``) and ``/logs/verifier`` are made afresh and the tests are copied in; the tests'
PATH holds no directory the agent could write; pytest loads only the plugins of the
packages the task installs (as in its image); every ``python`` they start through the
sandbox's tools skips user site-packages and finds an empty ``sitecustomize`` /
``usercustomize`` before any the agent planted (``envs/host_tools.py``); the reward is
read only from the directory made for the verifier, and only from a regular file.

Reward: ``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (``{"reward": x}``, or
the mean of its numeric values); a test script that writes neither is scored by its exit
status (0 -> 1.0, else 0.0). A verifier that is killed (timeout, output or memory limit),
or a reward file that is not a regular file (a symlink) scores 0.
Export (``export_task``) writes the Harbor layout; glmjax's own fields go in
``[metadata] glmjax`` (JSON) and partial solutions in ``solution/partial-N.sh``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shlex
import stat
import tomllib
from typing import Mapping

from envs import dockerfile, host_tools, installs, shell_syntax
from envs.base import Task
from envs.sandbox import RunResult, Sandbox
from envs.tree import read_tree

_DIFFICULTY = {"trivial": 1, "easy": 1, "medium": 3, "hard": 4, "expert": 5}
_DIFFICULTY_NAME = {1: "easy", 2: "easy", 3: "medium", 4: "hard", 5: "hard"}
_AGENT_WRITABLE = ("/app", "/tmp", "/logs", "/solution")


class UnsupportedTask(Exception):
    """The task's environment cannot be set up locally; the message says why."""


class HarborFormatError(ValueError):
    """A task directory's files are malformed; the message names the file and the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HarborTask(Task):
    """A sandboxed task. ``files``: the working directory's initial contents (paths
    relative to it); ``tmp_files``: what the image puts under ``/tmp``; ``solution``:
    ``solve.sh`` (install steps resolved);
    ``solution_files``: the rest of ``solution/`` (``solve.py``, data ...), copied in beside
    it; ``tests``: the tests/ directory; ``setup``: commands run before the agent (the
    Dockerfile's RUN lines); ``partials``: half-done solutions (each must score 0);
    ``installs``: how each install step was resolved; ``notes``: what the emulation left out;
    ``storage_bytes``: the task's ``[environment] storage_mb``, the largest file it may write.

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
    setup: tuple[str, ...] = ()
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
    install steps that cannot run offline replaced (``envs/installs.py``)."""
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
    """``limits`` with the task's own storage as the file-size cap, where it declares more."""
    if task.storage_bytes and task.storage_bytes > limits.file_bytes:
        return limits.replace(file_bytes=task.storage_bytes)
    return limits


def task_env(sandbox: Sandbox, task: HarborTask, *, verifier: bool = False) -> dict[str, str]:
    """The task's variables for a command: ``$PATH`` expanded against the sandbox's PATH;
    for the verifier, PATH without directories the agent could write, and no user site."""
    path = sandbox.env()["PATH"]
    env = {k: re.sub(r"\$\{PATH\}|\$PATH\b", path, _map(v, task, sandbox)) for k, v in task.env.items()}
    # pytest loads the plugins of what the task installs, as in its image, not every plugin of the host's
    env.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins = host_tools.pytest_plugins(p for i in task.installs for p in i.get("packages", ()))
    if plugins:
        env.setdefault("PYTEST_PLUGINS", ",".join(plugins))
    if verifier:
        writable = tuple(sandbox.path(d) for d in _AGENT_WRITABLE)
        entries = env.get("PATH", path).split(":")
        env["PATH"] = ":".join(e for e in entries if e and os.path.isabs(e) and not any(
            e == w or e.startswith(w + "/") for w in writable)) or path
        env["PYTHONNOUSERSITE"] = "1"
    return env


def prepare(sandbox: Sandbox, task: HarborTask) -> None:
    """Set up the task's environment in a fresh sandbox; ``UnsupportedTask`` if it cannot be."""
    if task.unsupported:
        raise UnsupportedTask(task.unsupported)
    for rel, data in task.files.items():
        sandbox.write_file(f"/app/{rel}", _map(data, task, sandbox))
    for rel, data in task.tmp_files.items():
        sandbox.write_file(f"/tmp/{rel}", _map(data, task, sandbox))
    for command in task.setup:
        result = sandbox.run(_map(command, task, sandbox, "RUN"), env=task_env(sandbox, task))
        if not result.ok:
            raise UnsupportedTask(f"environment setup failed locally: RUN {command!r} {result.summary()} "
                                  f"{result.output[-300:]}")


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
    for virtual in ("/tmp", "/tests", "/logs/verifier"):
        sandbox.reset_dir(virtual)
    for rel, data in task.tests.items():
        sandbox.write_file(f"/tests/{rel}", _map(data, task, sandbox, rel if rel.endswith(".sh") else None))
    limits = sandbox.limits.replace(wall_seconds=task.verifier_timeout)
    result = sandbox.run(_map(task.test_command, task, sandbox), limits=limits,
                         env=task_env(sandbox, task, verifier=True))
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


# ----- loading --------------------------------------------------------------------------------
def is_task_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "task.toml")) or os.path.isfile(os.path.join(path, "task.yaml"))


def find_tasks(paths: list[str]) -> list[str]:
    """Task directories: each path that is one, else the task directories below it."""
    found = []
    for path in paths:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path!r} is not a directory")
        if is_task_dir(path):
            found.append(path)
            continue
        for dirpath, dirnames, _ in os.walk(path):
            dirnames.sort()
            if is_task_dir(dirpath):
                found.append(dirpath)
                dirnames.clear()
    return found


def _read(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _difficulty(value) -> int:
    if isinstance(value, int):
        return min(max(value, 1), 5)
    return _DIFFICULTY.get(str(value).strip().lower(), 3)


def _task_id(path: str, meta: Mapping) -> str:
    name = meta.get("id") or os.path.basename(os.path.normpath(path))
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(name).split("/")[-1]).strip("-.") or "task"


def load_task(path: str) -> HarborTask:
    """A task directory in either format (see the module docstring)."""
    if os.path.isfile(os.path.join(path, "task.toml")):
        return _load_harbor(path)
    if os.path.isfile(os.path.join(path, "task.yaml")):
        return _load_terminal_bench(path)
    raise FileNotFoundError(f"{path!r} has neither task.toml (Harbor) nor task.yaml (Terminal-Bench)")


_NUMBER = (int, float)
_SCHEMA = {  # table -> {field: (types, what it must be)}; tables themselves must be tables
    "metadata": {"difficulty": ((str, int), "a string or an integer"), "category": ((str,), "a string"),
                 "glmjax": ((str,), "a JSON string")},
    "verifier": {"timeout_sec": (_NUMBER, "a number of seconds"), "env": ((dict,), "a table of strings")},
    "agent": {"timeout_sec": (_NUMBER, "a number of seconds")},
    "environment": {"docker_image": ((str,), "a string"), "workdir": ((str,), "a path")},
    "task": {"name": ((str,), "a string")},
    "solution": {}, "steps": None,
}


def _type_name(value) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(
        type(value), type(value).__name__)


def _task_toml(path: str) -> dict:
    """task.toml, its tables and the fields glmjax reads checked for type."""
    where = os.path.join(path, "task.toml")
    try:
        with open(where, "rb") as f:
            config = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise HarborFormatError(f"{where}: not valid TOML: {err}") from None
    for table, fields in _SCHEMA.items():
        if table not in config:
            continue
        value = config[table]
        if table == "steps":
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise HarborFormatError(f"{where}: steps must be an array of tables ([[steps]]), "
                                        f"got {_type_name(value)} {value!r}")
            continue
        if not isinstance(value, dict):
            raise HarborFormatError(f"{where}: [{table}] must be a table, got {_type_name(value)} {value!r}")
        for field, (types, what) in fields.items():
            if field in value and (not isinstance(value[field], types) or isinstance(value[field], bool)):
                raise HarborFormatError(f"{where}: [{table}] {field} must be {what}, got "
                                        f"{_type_name(value[field])} {value[field]!r}")
            if types == _NUMBER and field in value and value[field] <= 0:
                raise HarborFormatError(f"{where}: [{table}] {field} must be > 0, got {value[field]!r}")
    env = config.get("verifier", {}).get("env", {})
    bad = {k: v for k, v in env.items() if not isinstance(v, str)}
    if bad:
        raise HarborFormatError(f"{where}: [verifier] env values must be strings, got {bad!r}")
    return config


_RUNNERS = {"python", "python3", "bash", "sh", "node", "perl", "ruby", "source", "."}


def agent_writable_code(tests: Mapping[str, bytes], workdir: str) -> list[str]:
    """Notes on test scripts that run a file of the working directory (``python3
    /app/check.py``): the agent can edit it, so a verdict that rests on it can be forged."""
    notes = []
    for rel, data in tests.items():
        if not rel.endswith(".sh"):
            continue
        try:
            commands = shell_syntax.commands(data.decode())
        except (ValueError, UnicodeDecodeError):
            continue
        for command in commands:
            words = command.words
            target = words[1] if len(words) > 1 and words[0] in _RUNNERS else words[0] if words else ""
            if any(target == d or target.startswith(d.rstrip("/") + "/") for d in {workdir, "/app"}):
                notes.append(f"tests/{rel} runs {target}, which the agent can change: a verdict that rests on it "
                             "can be forged")
    return notes


def _scan_scripts(files: Mapping[str, bytes], where: str, path: str):
    """How the install steps of each shell script in ``files`` resolve: (installs, unsupported)."""
    found, unsupported = [], None
    for rel, data in files.items():
        if not rel.endswith(".sh"):
            continue
        try:
            result = installs.scan(data.decode(), f"{where}/{rel}", read=lambda p: _read(os.path.join(path, p)))
        except UnicodeDecodeError:
            continue
        except ValueError as err:
            raise HarborFormatError(f"{os.path.join(path, where, rel)}: {err}") from None
        found += result.installs
        unsupported = unsupported or result.unsupported
    return found, unsupported


def _image(path: str, envdir: str) -> dockerfile.Image:
    try:
        return dockerfile.emulate(os.path.join(envdir, "Dockerfile"), os.path.relpath(os.path.join(envdir, "Dockerfile"),
                                                                                 path))
    except dockerfile.DockerfileError as err:
        raise HarborFormatError(f"{path}: {err}") from None


def _load_harbor(path: str) -> HarborTask:
    config = _task_toml(path)
    meta = dict(config.get("metadata", {}))
    try:
        extra = json.loads(meta.pop("glmjax")) if "glmjax" in meta else {}
    except json.JSONDecodeError as err:
        raise HarborFormatError(f"{path}/task.toml: [metadata] glmjax is not valid JSON: {err}") from None
    steps = config.get("steps")
    instruction = _read(os.path.join(path, "instruction.md"))
    if instruction is None and not steps:
        raise FileNotFoundError(f"{path}: instruction.md is missing")
    envdir = os.path.join(path, "environment")
    image = _image(path, envdir)
    unsupported = image.unsupported
    environment = config.get("environment", {})
    if os.path.isfile(os.path.join(envdir, "docker-compose.yaml")):
        unsupported = "environment/docker-compose.yaml: multi-container environments need Docker"
    elif environment.get("docker_image") and not os.path.isfile(os.path.join(envdir, "Dockerfile")):
        unsupported = f"prebuilt image {environment['docker_image']!r} needs Docker"
    tests = read_tree(os.path.join(path, "tests"))
    test_installs, bad = _scan_scripts(tests, "tests", path)
    unsupported = unsupported or bad
    if "test.sh" not in tests and not steps:
        raise FileNotFoundError(f"{path}: tests/test.sh is missing")
    solution_files = read_tree(os.path.join(path, "solution"))
    solution_installs, bad = _scan_scripts(solution_files, "solution", path)
    unsupported = unsupported or bad
    partials = tuple(solution_files.pop(n).decode() for n in sorted(solution_files) if re.fullmatch(r"partial-\d+\.sh", n))
    solve = solution_files.pop("solve.sh", None)
    verifier = config.get("verifier", {})
    name = extra.get("id") or config.get("task", {}).get("name")
    task_id = _task_id(path, {"id": name} if name else {})
    agent_timeout = float(config.get("agent", {}).get("timeout_sec", 120.0))
    verifier_timeout = float(verifier.get("timeout_sec", 120.0))
    workdir = environment.get("workdir", image.workdir)
    loaded_steps = ()
    if steps:
        loaded_steps, step_installs, bad = _load_steps(path, config, task_id, tests, agent_timeout, verifier_timeout,
                                                       workdir, {**image.env, **verifier.get("env", {})})
        solution_installs, unsupported = solution_installs + step_installs, unsupported or bad
    all_installs = tuple(i.to_dict() for i in image.installs + test_installs + solution_installs)
    loaded_steps = tuple(s.replace(installs=all_installs) for s in loaded_steps)  # one environment for all steps
    strategy = config.get("multi_step_reward_strategy", "mean")
    if strategy not in ("mean", "final"):
        raise HarborFormatError(f"{path}/task.toml: multi_step_reward_strategy must be \"mean\" or \"final\", "
                                f"got {strategy!r}")
    return HarborTask(
        id=task_id, instruction=instruction or "", steps=loaded_steps, step_reward=strategy,
        domain=extra.get("domain", meta.get("category", "terminal")),
        difficulty=extra.get("difficulty", _difficulty(meta.get("difficulty", "medium"))),
        metadata={**meta, **extra.get("metadata", {})}, files=image.files, tmp_files=image.tmp_files,
        storage_bytes=_storage(path, environment),
        solution=solve.decode() if solve is not None else None, solution_files=solution_files, tests=tests,
        partials=partials, setup=tuple(image.setup), env={**image.env, **verifier.get("env", {})},
        agent_timeout=agent_timeout, verifier_timeout=verifier_timeout,
        workdir=workdir, unsupported=unsupported, source=os.path.abspath(path),
        installs=all_installs, notes=tuple(image.notes + agent_writable_code(tests, workdir)))


def _storage(path: str, environment: dict) -> int | None:
    value = environment.get("storage_mb")
    if value is None:
        return None
    if not isinstance(value, _NUMBER) or isinstance(value, bool) or value <= 0:
        raise HarborFormatError(f"{path}/task.toml: [environment] storage_mb must be a number > 0, got {value!r}")
    return int(value * (1 << 20))


def _load_steps(path: str, config: dict, task_id: str, task_tests: dict, agent_timeout: float,
                verifier_timeout: float, workdir: str, env: dict):
    """The ``[[steps]]`` of a task: (steps, their install steps, unsupported or None)."""
    where, out, found, unsupported = os.path.join(path, "task.toml"), [], [], None
    for i, entry in enumerate(config["steps"]):
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise HarborFormatError(f"{where}: [[steps]] number {i + 1} needs a name (a string), got {name!r}")
        for table in ("agent", "verifier"):
            if not isinstance(entry.get(table, {}), dict):
                raise HarborFormatError(f"{where}: [steps.{table}] of step {name!r} must be a table")
            timeout = entry.get(table, {}).get("timeout_sec")
            if timeout is not None and (not isinstance(timeout, _NUMBER) or isinstance(timeout, bool) or timeout <= 0):
                raise HarborFormatError(f"{where}: [steps.{table}] timeout_sec of step {name!r} must be a number "
                                        f"of seconds > 0, got {timeout!r}")
        min_reward = entry.get("min_reward")
        if isinstance(min_reward, dict):
            unsupported = unsupported or f"step {name!r}: a min_reward per reward key is not supported"
            min_reward = None
        elif min_reward is not None and (not isinstance(min_reward, _NUMBER) or isinstance(min_reward, bool)):
            raise HarborFormatError(f"{where}: min_reward of step {name!r} must be a number, got {min_reward!r}")
        root = os.path.join(path, "steps", name)
        instruction = _read(os.path.join(root, "instruction.md"))
        if instruction is None:
            raise FileNotFoundError(f"{path}: steps/{name}/instruction.md is missing")
        step_tests = read_tree(os.path.join(root, "tests"))
        tests = {**task_tests, **step_tests}  # the step's own files win, as Harbor uploads them last
        if "test.sh" not in tests:
            raise FileNotFoundError(f"{path}: neither steps/{name}/tests/test.sh nor tests/test.sh exists")
        solution_files = read_tree(os.path.join(root, "solution"))
        for files, kind in ((step_tests, "tests"), (solution_files, "solution")):
            more, bad = _scan_scripts(files, f"steps/{name}/{kind}", path)
            found, unsupported = found + more, unsupported or bad
        solve = solution_files.pop("solve.sh", None)
        out.append(HarborTask(
            id=_task_id(f"{task_id}.{name}", {}), instruction=instruction, domain="step", tests=tests,
            solution=solve.decode() if solve is not None else None, solution_files=solution_files, env=env,
            agent_timeout=float(entry.get("agent", {}).get("timeout_sec", agent_timeout)),
            verifier_timeout=float(entry.get("verifier", {}).get("timeout_sec", verifier_timeout)),
            workdir=workdir, min_reward=None if min_reward is None else float(min_reward)))
    return tuple(out), found, unsupported


def _yaml(text: str) -> dict:
    try:
        import yaml
    except ImportError:  # the keys glmjax reads: `key: value` and `key: |` blocks at the top level
        out, key, block = {}, None, []
        for line in text.splitlines() + ["end: ."]:
            if re.match(r"^\S[^:]*:", line):
                if key is not None:
                    out[key] = "\n".join(block).strip("\n") + "\n"
                    key = None
                name, _, value = line.partition(":")
                if value.strip() in ("|", "|-", ">"):
                    key, block = name.strip(), []
                else:
                    out[name.strip()] = value.strip().strip("'\"")
            elif key is not None:
                block.append(line[2:] if line.startswith("  ") else line.strip())
        return out
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise HarborFormatError(f"not valid YAML: {err}") from None


def _load_terminal_bench(path: str) -> HarborTask:
    where = os.path.join(path, "task.yaml")
    config = _yaml(_read(where))
    if not isinstance(config, dict):
        raise HarborFormatError(f"{where}: must be a mapping, got {_type_name(config)}")
    instruction = config.get("instruction") or (config.get("descriptions") or [{}])[0].get("description")
    if not instruction:
        raise HarborFormatError(f"{where}: has no instruction")
    for field in ("max_agent_timeout_sec", "max_test_timeout_sec"):
        if field in config and (not isinstance(config[field], _NUMBER) or isinstance(config[field], bool)):
            raise HarborFormatError(f"{where}: {field} must be a number of seconds, got {config[field]!r}")
    image = _image(path, path)
    unsupported = image.unsupported
    compose = _read(os.path.join(path, "docker-compose.yaml"))
    if compose and len(re.findall(r"^  [\w-]+:\s*$", compose.split("services:", 1)[-1], re.M)) > 1:
        unsupported = "docker-compose.yaml has several services: multi-container environments need Docker"
    solution = _read(os.path.join(path, "solution.sh"))
    if solution is None and os.path.isfile(os.path.join(path, "solution.yaml")):
        steps = _yaml(_read(os.path.join(path, "solution.yaml")))
        if isinstance(steps, list) and steps:
            solution = "\n".join(s["command"] if isinstance(s, dict) else str(s) for s in steps) + "\n"
    runner = _read(os.path.join(path, "run-tests.sh"))
    if runner is None:
        raise FileNotFoundError(f"{path}: run-tests.sh is missing")
    tests = {**read_tree(os.path.join(path, "tests")), "run-tests.sh": runner.encode()}
    test_installs, bad = _scan_scripts(tests, "tests", path)
    unsupported = unsupported or bad
    solution_installs = []
    if solution is not None:
        solution_installs, bad = _scan_scripts({"solution.sh": solution.encode()}, ".", path)
        unsupported = unsupported or bad
    return HarborTask(
        id=_task_id(path, {}), instruction=instruction, domain=str(config.get("category", "terminal")),
        difficulty=_difficulty(config.get("difficulty", "medium")),
        metadata={k: config[k] for k in ("category", "tags", "author_email") if k in config},
        files=image.files, tmp_files=image.tmp_files, solution=solution, tests=tests,
        test_command="bash /tests/run-tests.sh",
        setup=tuple(image.setup), env=image.env,
        agent_timeout=float(config.get("max_agent_timeout_sec", 180.0)),
        verifier_timeout=float(config.get("max_test_timeout_sec", 60.0)), workdir=image.workdir,
        unsupported=unsupported, source=os.path.abspath(path),
        installs=tuple(i.to_dict() for i in image.installs + test_installs + solution_installs),
        notes=tuple(image.notes))


def load_tasks(paths: list[str]) -> list[HarborTask]:
    return [load_task(p) for p in find_tasks(paths)]


# ----- export ---------------------------------------------------------------------------------
def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _write(path: str, data: str | bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    if (data.encode() if isinstance(data, str) else data).startswith(b"#!") or path.endswith(".sh"):
        os.chmod(path, 0o755)


def export_task(task: HarborTask, out_dir: str) -> str:
    """Write ``task`` as a Harbor task directory ``out_dir/<task.id>``; returns its path."""
    if task.test_command != "bash /tests/test.sh":
        raise ValueError(f"{task.id}: only tasks run by tests/test.sh export to Harbor (got {task.test_command!r})")
    root = os.path.join(out_dir, task.id)
    plain = {k: v for k, v in task.metadata.items() if isinstance(v, (str, int, float, bool))}
    glmjax = {"id": task.id, "domain": task.domain, "difficulty": task.difficulty, "metadata": dict(task.metadata)}
    lines = ['version = "1.0"', "", "[metadata]", f"difficulty = {_toml_value(_DIFFICULTY_NAME[task.difficulty])}",
             f"category = {_toml_value(task.domain)}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(plain.items()) if k not in ("difficulty", "category", "glmjax")]
    lines += [f"glmjax = {_toml_value(json.dumps(glmjax, sort_keys=True, default=str))}", "",
              "[verifier]", f"timeout_sec = {float(task.verifier_timeout)!r}", "",
              "[agent]", f"timeout_sec = {float(task.agent_timeout)!r}", "", "[environment]", "cpus = 1",
              "memory_mb = 2048", ""]
    if task.steps:
        lines.insert(1, f"multi_step_reward_strategy = {_toml_value(task.step_reward)}")
    for step in task.steps:
        name = step.id.split(".", 1)[1] if step.id.startswith(task.id + ".") else step.id
        lines += ["[[steps]]", f"name = {_toml_value(name)}"]
        lines += [f"min_reward = {step.min_reward!r}"] if step.min_reward is not None else []
        lines += ["", "[steps.agent]", f"timeout_sec = {float(step.agent_timeout)!r}", "",
                  "[steps.verifier]", f"timeout_sec = {float(step.verifier_timeout)!r}", ""]
        base = os.path.join(root, "steps", name)
        _write(os.path.join(base, "instruction.md"), step.instruction)
        if step.solution is not None:
            _write(os.path.join(base, "solution", "solve.sh"), step.solution)
        for rel, data in step.solution_files.items():
            _write(os.path.join(base, "solution", rel), data)
        for rel, data in step.tests.items():
            if task.tests.get(rel) != data:
                _write(os.path.join(base, "tests", rel), data)
    _write(os.path.join(root, "task.toml"), "\n".join(lines))
    _write(os.path.join(root, "instruction.md"), task.instruction)
    docker = ["FROM python:3.11-slim", f"WORKDIR {task.workdir}"]
    docker += [f"ENV {k}={json.dumps(v)}" for k, v in task.env.items()]
    if task.files:
        docker.append(f"COPY app/ {task.workdir}/")
    docker += [f"RUN {c}" for c in task.setup]
    _write(os.path.join(root, "environment", "Dockerfile"), "\n".join(docker) + "\n")
    for rel, data in task.files.items():
        _write(os.path.join(root, "environment", "app", rel), data)
    if task.solution is not None:
        _write(os.path.join(root, "solution", "solve.sh"), task.solution)
    for rel, data in task.solution_files.items():
        _write(os.path.join(root, "solution", rel), data)
    for i, partial in enumerate(task.partials):
        _write(os.path.join(root, "solution", f"partial-{i}.sh"), partial)
    for rel, data in task.tests.items():
        _write(os.path.join(root, "tests", rel), data)
    return root
