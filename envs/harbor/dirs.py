"""Harbor / Terminal-Bench task directories: find, load and export them.

Formats read (``load_task``):

    Harbor                              Terminal-Bench (older)
    instruction.md                      task.yaml (instruction, difficulty, max_*_timeout_sec)
    task.toml ([metadata] [agent]       Dockerfile, docker-compose.yaml (one service)
      [verifier] [environment])         solution.sh (or solution.yaml: a list of commands)
    environment/Dockerfile              run-tests.sh, tests/...
    solution/ (solve.sh, solve.py, ..., partial-*.sh)
    tests/ (test.sh, test_outputs.py, ...)
    steps/<name>/ (instruction.md, tests/, solution/) for each [[steps]] entry

The image is built from the Dockerfile and build context the task's compose file or
layout names (``envs/image/context.py``, ``envs/image/build.py``: a layer cached on the
machine, with its install steps fetched from the registries); install steps in the tests'
and in the solution's scripts are resolved against the host (``envs/image/installs.py``):
what the host has satisfies them and is noted in ``HarborTask.installs``; what cannot be
had, and a step the build cannot reproduce, makes the task *unsupported* (reported with
the reason, naming the file and line, never silently passed), as do a second container in
the compose file and a prebuilt image. A multi-step task's steps each have
their own instruction, tests layered over the task's, and solution. A malformed
``task.toml`` raises ``HarborFormatError`` naming the file, the field and the type it
must have. Export (``export_task``) writes the Harbor layout; glmjax's own fields go in
``[metadata] glmjax`` (JSON) and partial solutions in ``solution/partial-N.sh``.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from typing import Mapping

from envs.harbor.task import HarborTask
from envs.image import build, context, dockerfile, installs, shell_syntax
from envs.sandbox.tree import read_tree

_DIFFICULTY = {"trivial": 1, "easy": 1, "medium": 3, "hard": 4, "expert": 5}
_DIFFICULTY_NAME = {1: "easy", 2: "easy", 3: "medium", 4: "hard", 5: "hard"}


class HarborFormatError(ValueError):
    """A task directory's files are malformed; the message names the file and the field."""


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
    "agent": {"timeout_sec": (_NUMBER, "a number of seconds"), "user": ((str,), "a user name")},
    "environment": {"docker_image": ((str,), "a string"), "workdir": ((str,), "a path"),
                    "env": ((dict,), "a table of strings")},
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


def _image(path: str, layout: str, workdir: str | None, docker_image: str | None, scripts) -> build.Image:
    """The task's image, built from its Dockerfile (or from the cache), with what the task's
    ``scripts`` (their ``Install`` steps) fetch in its layer."""
    try:
        source = context.locate(path, layout, docker_image)
        if source.unsupported:
            return build.Image(None, workdir or "/app", unsupported=source.unsupported)
        return build.build(source, workdir, installs.wanted(scripts))
    except (dockerfile.DockerfileError, ValueError) as err:
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
    environment = config.get("environment", {})
    tests = read_tree(os.path.join(path, "tests"))
    test_installs, unsupported = _scan_scripts(tests, "tests", path)
    if "test.sh" not in tests and not steps:
        raise FileNotFoundError(f"{path}: tests/test.sh is missing")
    solution_files = read_tree(os.path.join(path, "solution"))
    solution_installs, bad = _scan_scripts(solution_files, "solution", path)
    unsupported = unsupported or bad
    partials = tuple(solution_files.pop(n).decode() for n in sorted(solution_files)
                     if re.fullmatch(r"partial-\d+\.sh", n))
    solve = solution_files.pop("solve.sh", None)
    verifier = config.get("verifier", {})
    name = extra.get("id") or config.get("task", {}).get("name")
    task_id = _task_id(path, {"id": name} if name else {})
    agent_timeout = float(config.get("agent", {}).get("timeout_sec", 120.0))
    verifier_timeout = float(verifier.get("timeout_sec", 120.0))
    loaded_steps = ()
    if steps:
        loaded_steps, step_installs, bad = _load_steps(path, config, task_id, tests, agent_timeout, verifier_timeout)
        solution_installs, unsupported = solution_installs + step_installs, unsupported or bad
    scripts = test_installs + solution_installs
    image = _image(path, "harbor", environment.get("workdir"), environment.get("docker_image"), scripts)
    unsupported = image.unsupported or unsupported
    files, modes = image.contents("app")
    workdir, env = image.workdir, {**image.env, **environment.get("env", {}), **verifier.get("env", {})}
    all_installs = image.installs + tuple(i.to_dict() for i in scripts)
    user = config.get("agent", {}).get("user") or image.user
    # one environment for all steps; a step's verifier has its own variables too
    loaded_steps = tuple(s.replace(installs=all_installs, workdir=workdir, env={**env, **s.env}, user=user)
                         for s in loaded_steps)
    strategy = config.get("multi_step_reward_strategy", "mean")
    if strategy not in ("mean", "final"):
        raise HarborFormatError(f"{path}/task.toml: multi_step_reward_strategy must be \"mean\" or \"final\", "
                                f"got {strategy!r}")
    return HarborTask(
        id=task_id, instruction=instruction or "", steps=loaded_steps, step_reward=strategy,
        domain=extra.get("domain", meta.get("category", "terminal")),
        difficulty=extra.get("difficulty", _difficulty(meta.get("difficulty", "medium"))),
        metadata={**meta, **extra.get("metadata", {})}, files=files, modes=modes, tmp_files=image.contents("tmp")[0],
        layer=image.layer,
        storage_bytes=_storage(path, environment),
        solution=solve.decode() if solve is not None else None, solution_files=solution_files, tests=tests,
        partials=partials, env=env,
        agent_timeout=agent_timeout, verifier_timeout=verifier_timeout,
        workdir=workdir, unsupported=unsupported, source=os.path.abspath(path), user=user,
        installs=all_installs, notes=image.notes + tuple(agent_writable_code(tests, workdir)))


def _storage(path: str, environment: dict) -> int | None:
    value = environment.get("storage_mb")
    if value is None:
        return None
    if not isinstance(value, _NUMBER) or isinstance(value, bool) or value <= 0:
        raise HarborFormatError(f"{path}/task.toml: [environment] storage_mb must be a number > 0, got {value!r}")
    return int(value * (1 << 20))


def _load_steps(path: str, config: dict, task_id: str, task_tests: dict, agent_timeout: float,
                verifier_timeout: float):
    """The ``[[steps]]`` of a task: (steps, their install steps, unsupported or None); the
    image's working directory and variables are the caller's to set."""
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
            solution=solve.decode() if solve is not None else None, solution_files=solution_files,
            env=dict(entry.get("verifier", {}).get("env", {})),
            agent_timeout=float(entry.get("agent", {}).get("timeout_sec", agent_timeout)),
            verifier_timeout=float(entry.get("verifier", {}).get("timeout_sec", verifier_timeout)),
            min_reward=None if min_reward is None else float(min_reward)))
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
    solution = _read(os.path.join(path, "solution.sh"))
    if solution is None and os.path.isfile(os.path.join(path, "solution.yaml")):
        steps = _yaml(_read(os.path.join(path, "solution.yaml")))
        if isinstance(steps, list) and steps:
            solution = "\n".join(s["command"] if isinstance(s, dict) else str(s) for s in steps) + "\n"
    runner = _read(os.path.join(path, "run-tests.sh"))
    if runner is None:
        raise FileNotFoundError(f"{path}: run-tests.sh is missing")
    tests = {**read_tree(os.path.join(path, "tests")), "run-tests.sh": runner.encode()}
    test_installs, unsupported = _scan_scripts(tests, "tests", path)
    solution_installs = []
    if solution is not None:
        solution_installs, bad = _scan_scripts({"solution.sh": solution.encode()}, ".", path)
        unsupported = unsupported or bad
    scripts = test_installs + solution_installs
    image = _image(path, "terminal-bench", None, None, scripts)
    unsupported = image.unsupported or unsupported
    files, modes = image.contents("app")
    return HarborTask(
        id=_task_id(path, {}), instruction=instruction, domain=str(config.get("category", "terminal")),
        difficulty=_difficulty(config.get("difficulty", "medium")),
        metadata={k: config[k] for k in ("category", "tags", "author_email") if k in config},
        files=files, modes=modes, tmp_files=image.contents("tmp")[0], layer=image.layer, solution=solution,
        tests=tests, test_command="bash /tests/run-tests.sh", env=image.env,
        agent_timeout=float(config.get("max_agent_timeout_sec", 180.0)),
        verifier_timeout=float(config.get("max_test_timeout_sec", 60.0)), workdir=image.workdir, user=image.user,
        unsupported=unsupported, source=os.path.abspath(path),
        installs=image.installs + tuple(i.to_dict() for i in scripts), notes=image.notes)


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
    if task.layer:
        raise ValueError(f"{task.id}: its image was built from its own Dockerfile ({task.source}); that directory "
                         "is its Harbor export")
    root = os.path.join(out_dir, task.id)
    plain = {k: v for k, v in task.metadata.items() if isinstance(v, (str, int, float, bool))}
    glmjax = {"id": task.id, "domain": task.domain, "difficulty": task.difficulty, "metadata": dict(task.metadata)}
    lines = ['version = "1.0"', "", "[metadata]", f"difficulty = {_toml_value(_DIFFICULTY_NAME[task.difficulty])}",
             f"category = {_toml_value(task.domain)}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(plain.items())
              if k not in ("difficulty", "category", "glmjax")]
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
