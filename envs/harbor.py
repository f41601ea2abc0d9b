"""Harbor / Terminal-Bench task directories: load, run locally in a ``Sandbox``, export.

Formats read (``load_task``):

    Harbor                              Terminal-Bench (older)
    instruction.md                      task.yaml (instruction, difficulty, max_*_timeout_sec)
    task.toml ([metadata] [agent]       Dockerfile, docker-compose.yaml (one service)
      [verifier] [environment])         solution.sh (or solution.yaml: a list of commands)
    environment/Dockerfile              run-tests.sh, tests/...
    solution/solve.sh (+ partial-*.sh)
    tests/test.sh, tests/...

Running without Docker. The sandbox's ``/app`` stands for the container's working
directory (the Dockerfile's last ``WORKDIR``; occurrences of that path in scripts are
rewritten to ``/app``), ``/logs/verifier`` is the verifier's log directory, ``/tests`` and
``/solution`` hold the tests and the reference solution (copied in only when they run:
tests after the agent has finished, the solution only for oracle runs). Under the chroot
sandbox these are the real paths the commands see; in the plain fallback they are
rewritten to the sandbox's host paths (``Sandbox.rewrite``) and exported as ``$APP_DIR``,
``$LOGS_DIR``, ``$TEST_DIR``. The Dockerfile is emulated: ``COPY``/``ADD`` of local files
into the working directory, ``ENV``, ``WORKDIR``; ``RUN`` lines run in the sandbox (no
network, unprivileged) before the agent starts. A task is *unsupported* (reported, never
silently passed) when its environment cannot be set up that way: a multi-service compose
file, a prebuilt image, ``COPY`` outside the working directory or from a build stage,
``RUN`` or test scripts that install packages or fetch from the network, or a ``RUN`` that
fails locally.

Reward: ``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (``{"reward": x}``, or
the mean of its numeric values); a test script that writes neither is scored by its exit
status (0 -> 1.0, else 0.0). A verifier that is killed (timeout, output limit) scores 0.
Export (``export_task``) writes the Harbor layout; glmjax's own fields go in
``[metadata] glmjax`` (JSON) and partial solutions in ``solution/partial-N.sh``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import tomllib
from typing import Mapping

from envs.base import Task
from envs.sandbox import RunResult, Sandbox

_DIFFICULTY = {"trivial": 1, "easy": 1, "medium": 3, "hard": 4, "expert": 5}
_DIFFICULTY_NAME = {1: "easy", 2: "easy", 3: "medium", 4: "hard", 5: "hard"}
_NEEDS_NETWORK = re.compile(r"\b(apt-get|apt|apk|yum|dnf|conda|npm|yarn|curl|wget)\b|\bpip3?\s+install|"
                            r"\buvx?\s|\bgit\s+clone")


class UnsupportedTask(Exception):
    """The task's environment cannot be set up locally; the message says why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HarborTask(Task):
    """A sandboxed task. ``files``: the working directory's initial contents (paths
    relative to it); ``tests``: the tests/ directory; ``setup``: commands run before the
    agent (the Dockerfile's RUN lines); ``partials``: half-done solutions (each must score 0)."""

    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    solution: str | None = None
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

    def replace(self, **changes) -> "HarborTask":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A verifier run: the reward, where it came from ("reward.txt" | "reward.json" |
    "exit status" | "killed" | "unreadable reward"), and the test command's result."""

    reward: float
    source: str
    result: RunResult

    def detail(self, tail: int = 600) -> str:
        return f"reward {self.reward} from {self.source} {self.result.summary()}: ...{self.result.output[-tail:]}"


# ----- running ---------------------------------------------------------------------------------
def _map(text: str | bytes, task: HarborTask, sandbox: Sandbox) -> str | bytes:
    if isinstance(text, bytes):
        try:
            return _map(text.decode(), task, sandbox).encode()
        except UnicodeDecodeError:
            return text
    if task.workdir != "/app":
        text = re.sub(r"(?<![\w./-])" + re.escape(task.workdir.rstrip("/")) + r"(?=[/\s\"'`;:)|&<>]|$)", "/app", text)
    return sandbox.rewrite(text)


def prepare(sandbox: Sandbox, task: HarborTask) -> None:
    """Set up the task's environment in a fresh sandbox; ``UnsupportedTask`` if it cannot be."""
    if task.unsupported:
        raise UnsupportedTask(task.unsupported)
    for rel, data in task.files.items():
        sandbox.write_file(f"/app/{rel}", _map(data, task, sandbox))
    for command in task.setup:
        result = sandbox.run(_map(command, task, sandbox), env=task.env)
        if not result.ok:
            raise UnsupportedTask(f"environment setup failed locally: RUN {command!r} {result.summary()} "
                                  f"{result.output[-300:]}")


def run_script(sandbox: Sandbox, task: HarborTask, script: str) -> RunResult:
    """Run ``script`` as the solution would run (``bash /solution/solve.sh`` in ``/app``)."""
    sandbox.reset_dir("/solution")
    sandbox.write_file("/solution/solve.sh", _map(script, task, sandbox))
    limits = sandbox.limits.replace(wall_seconds=min(sandbox.limits.wall_seconds, task.agent_timeout))
    return sandbox.run(f"bash {shlex.quote(sandbox.path('/solution/solve.sh'))}", limits=limits, env=task.env)


def run_tests(sandbox: Sandbox, task: HarborTask) -> Verdict:
    """Copy the tests in, run them with a fresh ``/logs/verifier``, read the reward."""
    sandbox.reset_dir("/tests")
    sandbox.reset_dir("/logs/verifier")
    for rel, data in task.tests.items():
        sandbox.write_file(f"/tests/{rel}", _map(data, task, sandbox))
    limits = sandbox.limits.replace(wall_seconds=task.verifier_timeout)
    result = sandbox.run(_map(task.test_command, task, sandbox), limits=limits, env=task.env)
    if result.killed:
        return Verdict(0.0, "killed", result)
    text = sandbox.read_bytes("/logs/verifier/reward.txt", 4096)
    if text is not None:
        try:
            return Verdict(float(text.decode().strip()), "reward.txt", result)
        except ValueError:
            return Verdict(0.0, "unreadable reward", result)
    blob = sandbox.read_bytes("/logs/verifier/reward.json", 1 << 16)
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


def _tree(top: str) -> dict[str, bytes]:
    files = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    files[os.path.relpath(full, top)] = f.read()
    return files


def _read(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _dockerfile(path: str) -> dict:
    """Emulate a Dockerfile: {workdir, files, setup, env, unsupported}."""
    state = {"workdir": "/app", "files": {}, "setup": [], "env": {}, "unsupported": None}
    text = _read(path)
    if text is None:
        return state
    context, copies = os.path.dirname(path), []
    lines = re.sub(r"\\\n", " ", text).splitlines()
    for line in (raw.strip() for raw in lines):
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        op, arg = op.upper(), arg.strip()
        if op == "WORKDIR":
            state["workdir"] = os.path.normpath(os.path.join(state["workdir"], arg))
        elif op in ("COPY", "ADD"):
            words = json.loads(arg) if arg.startswith("[") else shlex.split(arg)
            flags = [w for w in words if w.startswith("--")]
            words = [w for w in words if not w.startswith("--")]
            if any(f.startswith("--from") for f in flags) or any("://" in w for w in words):
                state["unsupported"] = f"{op} from a build stage or URL: {line!r}"
                continue
            copies.append((words[:-1], os.path.join(state["workdir"], words[-1]), words[-1].endswith("/")))
        elif op == "RUN":
            if _NEEDS_NETWORK.search(arg):
                state["unsupported"] = f"RUN installs packages or uses the network, which needs a container build: {arg!r}"
            state["setup"].append(arg)
        elif op == "ENV":
            pairs = re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", arg) or [tuple(arg.split(None, 1))]
            state["env"].update({k: v.strip('"') for k, v in pairs})
    workdir = state["workdir"]
    for sources, dest, into_dir in copies:
        dest = os.path.normpath(dest)
        if dest != workdir and not dest.startswith(workdir + "/"):
            state["unsupported"] = f"COPY to {dest} outside the working directory {workdir}"
            continue
        rel_dest = os.path.relpath(dest, workdir)
        for src in sources:
            full = os.path.normpath(os.path.join(context, src))
            if os.path.isdir(full):
                for rel, data in _tree(full).items():
                    state["files"][os.path.normpath(os.path.join(rel_dest, rel))] = data
            elif os.path.isfile(full):
                target = os.path.join(rel_dest, os.path.basename(src)) if into_dir or len(sources) > 1 else rel_dest
                state["files"][os.path.normpath(target)] = open(full, "rb").read()
            else:
                state["unsupported"] = f"COPY source {src!r} not found in {context}"
    return state


def _difficulty(value) -> int:
    if isinstance(value, int):
        return min(max(value, 1), 5)
    return _DIFFICULTY.get(str(value).strip().lower(), 3)


def _task_id(path: str, meta: Mapping) -> str:
    name = meta.get("id") or os.path.basename(os.path.normpath(path))
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-.") or "task"


def _unsupported_tests(tests: Mapping[str, bytes], command_file: str) -> str | None:
    script = tests.get(command_file, b"")
    script = script.decode(errors="replace") if isinstance(script, bytes) else script
    hit = _NEEDS_NETWORK.search(script)
    return f"{command_file} installs packages or uses the network ({hit.group(0).strip()!r})" if hit else None


def load_task(path: str) -> HarborTask:
    """A task directory in either format (see the module docstring)."""
    if os.path.isfile(os.path.join(path, "task.toml")):
        return _load_harbor(path)
    if os.path.isfile(os.path.join(path, "task.yaml")):
        return _load_terminal_bench(path)
    raise FileNotFoundError(f"{path!r} has neither task.toml (Harbor) nor task.yaml (Terminal-Bench)")


def _load_harbor(path: str) -> HarborTask:
    with open(os.path.join(path, "task.toml"), "rb") as f:
        config = tomllib.load(f)
    meta = dict(config.get("metadata", {}))
    extra = json.loads(meta.pop("glmjax")) if isinstance(meta.get("glmjax"), str) else {}
    instruction = _read(os.path.join(path, "instruction.md"))
    if instruction is None:
        raise FileNotFoundError(f"{path}: instruction.md is missing")
    envdir = os.path.join(path, "environment")
    docker = _dockerfile(os.path.join(envdir, "Dockerfile"))
    unsupported = docker["unsupported"]
    if os.path.isfile(os.path.join(envdir, "docker-compose.yaml")):
        unsupported = "environment/docker-compose.yaml: multi-container environments need Docker"
    elif config.get("environment", {}).get("docker_image") and not os.path.isfile(os.path.join(envdir, "Dockerfile")):
        unsupported = f"prebuilt image {config['environment']['docker_image']!r} needs Docker"
    tests = _tree(os.path.join(path, "tests"))
    if "test.sh" not in tests:
        raise FileNotFoundError(f"{path}: tests/test.sh is missing")
    unsupported = unsupported or _unsupported_tests(tests, "test.sh")
    solution_dir = os.path.join(path, "solution")
    partials = tuple(_read(os.path.join(solution_dir, n)) for n in sorted(os.listdir(solution_dir))
                     if re.fullmatch(r"partial-\d+\.sh", n)) if os.path.isdir(solution_dir) else ()
    verifier = config.get("verifier", {})
    name = extra.get("id") or config.get("task", {}).get("name")
    return HarborTask(
        id=_task_id(path, {"id": name} if name else {}), instruction=instruction, domain=extra.get("domain", meta.get("category", "terminal")),
        difficulty=extra.get("difficulty", _difficulty(meta.get("difficulty", "medium"))),
        metadata={**meta, **extra.get("metadata", {})}, files=docker["files"],
        solution=_read(os.path.join(solution_dir, "solve.sh")), tests=tests, partials=partials,
        setup=tuple(docker["setup"]), env={**docker["env"], **verifier.get("env", {})},
        agent_timeout=float(config.get("agent", {}).get("timeout_sec", 120.0)),
        verifier_timeout=float(verifier.get("timeout_sec", 120.0)), workdir=docker["workdir"],
        unsupported=unsupported, source=os.path.abspath(path))


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
    return yaml.safe_load(text) or {}


def _load_terminal_bench(path: str) -> HarborTask:
    config = _yaml(_read(os.path.join(path, "task.yaml")))
    instruction = config.get("instruction") or (config.get("descriptions") or [{}])[0].get("description")
    if not instruction:
        raise ValueError(f"{path}/task.yaml has no instruction")
    docker = _dockerfile(os.path.join(path, "Dockerfile"))
    unsupported = docker["unsupported"]
    compose = _read(os.path.join(path, "docker-compose.yaml"))
    if compose and len(re.findall(r"^  [\w-]+:\s*$", compose.split("services:", 1)[-1], re.M)) > 1:
        unsupported = "docker-compose.yaml has several services: multi-container environments need Docker"
    solution = _read(os.path.join(path, "solution.sh"))
    if solution is None and os.path.isfile(os.path.join(path, "solution.yaml")):
        steps = _yaml(_read(os.path.join(path, "solution.yaml")))
        if isinstance(steps, list) and steps:
            solution = "\n".join(s["command"] if isinstance(s, dict) else str(s) for s in steps) + "\n"
    tests = _tree(os.path.join(path, "tests"))
    runner = _read(os.path.join(path, "run-tests.sh"))
    if runner is None:
        raise FileNotFoundError(f"{path}: run-tests.sh is missing")
    tests["run-tests.sh"] = runner.encode()
    unsupported = unsupported or _unsupported_tests(tests, "run-tests.sh")
    return HarborTask(
        id=_task_id(path, {}), instruction=instruction, domain=str(config.get("category", "terminal")),
        difficulty=_difficulty(config.get("difficulty", "medium")),
        metadata={k: config[k] for k in ("category", "tags", "author_email") if k in config},
        files=docker["files"], solution=solution, tests=tests, test_command="bash /tests/run-tests.sh",
        setup=tuple(docker["setup"]), env=docker["env"],
        agent_timeout=float(config.get("max_agent_timeout_sec", 180.0)),
        verifier_timeout=float(config.get("max_test_timeout_sec", 60.0)), workdir=docker["workdir"],
        unsupported=unsupported, source=os.path.abspath(path))


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
    for i, partial in enumerate(task.partials):
        _write(os.path.join(root, "solution", f"partial-{i}.sh"), partial)
    for rel, data in task.tests.items():
        _write(os.path.join(root, "tests", rel), data)
    return root
