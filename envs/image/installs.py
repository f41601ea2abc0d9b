"""The install steps of a task's scripts, found without running them: what the host has,
what must be fetched into the task's layer before the sandbox starts, what cannot be had.

``scan(script, where)`` reads a test or solution script (or a Dockerfile ``RUN`` line) with
``envs/image/shell_syntax.py`` (tree-sitter-bash: comments and here-document bodies are not
commands, command substitutions are) and returns every install step it finds, each
resolved by ``envs/image/host_tools.py``:

    apt-get / apt / apk / yum / dnf install P   P present on the host (dpkg, a command), else
                                                  fetched: Debian's P (``Install.debian``;
                                                  ``python3-X``: PyPI's X)
    pip / pip3 / python -m pip / uv pip install   each requirement fetched for the sandbox's
    uv add, uvx --with R, uv run --with R         python (``Install.packages``) unless the
                                                  host has it as asked
    uvx TOOL                                      TOOL present (pytest always is), else fetched
    uv run TOOL                                   TOOL present
    curl|wget URL | sh  (the uv installer)        replaced: uv and uvx are the sandbox's own
    source $HOME/.local/bin/env, cp ~/.local/bin/uv ...   replaced: uv is the sandbox's
    rm -rf /var/lib/apt/lists/*, chmod/chown of /logs     replaced: nothing to do here
    curl / wget / git clone of a remote URL,      missing: they need the network
    npm / yarn / cargo / go / gem / conda installs, pip install of a local path or URL

What is to be fetched (``Scan.python``, ``Scan.debian``, or ``wanted(steps)``) goes into
the task's layer through ``envs/image/packages.py`` at build time, outside the sandbox;
the stand-ins (apt-get, pip, uv, uvx are on the sandbox's PATH) then find it there when
the script runs, and fail naming it when it was not fetched (the sandbox has no network).
The few steps that cannot run without a network are replaced by ``true`` in
``Scan.script``. A task is unsupported when any step is ``missing``; ``Scan.unsupported``
says which and why.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

from envs.image import host_tools, shell_syntax

_WRAPPERS = {"sudo", "env", "command", "exec", "nice", "nohup", "time", "stdbuf", "timeout"}
_SHELLS = {"sh", "bash", "dash", "zsh"}
_UV_INSTALLER = re.compile(r"astral\.sh/uv|/uv/releases/.*installer|uv-installer")
_LOCAL_URL = re.compile(r"^\w+://(localhost|127\.\d+\.\d+\.\d+|0\.0\.0\.0|\[::1\])(:\d+)?(/|$)")
_ENV_FILE = re.compile(r"(\$HOME|\$\{HOME\}|~|/root)/(\.local/bin/env|\.cargo/env)$")
_APT_CACHE = re.compile(r"^/var/(lib/apt/lists|cache/apt)(/|$)")
_UV_BINARY = re.compile(r"(\.local|\.cargo)/bin/uvx?$")
_PYTHON_ALIAS = re.compile(r"^/usr/(local/)?bin/(python3?|pip3?)$")
_NETWORK_INSTALLERS = {"npm": {"install", "i", "ci", "add"}, "yarn": {"install", "add", ""},
                       "pnpm": {"install", "add", "i"}, "cargo": {"install"}, "go": {"install", "get"},
                       "gem": {"install"}, "conda": {"install", "create"}, "mamba": {"install", "create"},
                       "pipx": {"install"}, "rustup": {"install", "default", "toolchain"},
                       "nvm": {"install"}, "bun": {"install", "add"}}


@dataclasses.dataclass(frozen=True)
class Install:
    """One install step: where it is, the command as written, what resolved it, what is
    missing (empty when it can be had), whether the script runs ``true`` in its place, the
    python requirements it installs (fetched where the host lacks them; their pytest plugins
    the sandbox then loads) and the Debian packages to fetch for it."""

    where: str
    command: str
    notes: tuple[str, ...]
    missing: tuple[str, ...] = ()
    replaced: bool = False
    packages: tuple[str, ...] = ()  # the python requirements it installs
    debian: tuple[str, ...] = ()  # the Debian packages the host lacks

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Scan:
    script: str
    installs: tuple[Install, ...]

    @property
    def unsupported(self) -> str | None:
        bad = [i for i in self.installs if i.missing]
        if not bad:
            return None
        first = bad[0]
        more = f" (and {len(bad) - 1} more install steps)" if len(bad) > 1 else ""
        return f"{first.where}: `{first.command}`: " + "; ".join(first.notes) + more

    @property
    def python(self) -> list[str]:
        return wanted(self.installs)[0]

    @property
    def debian(self) -> list[str]:
        return wanted(self.installs)[1]


def wanted(steps) -> tuple[list[str], list[str]]:
    """(python requirements, Debian packages) to fetch into the layer for ``steps``
    (``Install``s or their ``to_dict()``s), each once, in order."""
    steps = [s.to_dict() if isinstance(s, Install) else s for s in steps]
    python = dict.fromkeys(r for s in steps for r in s.get("packages", ()))
    debian = dict.fromkeys(d for s in steps for d in s.get("debian", ()))
    return list(python), list(debian)


def _unwrap(words: list[str]) -> list[str]:
    """The command under ``sudo``, ``env A=b``, ``timeout 60`` ...; ``python -m pip`` is pip."""
    if words[:1] == ["command"] and words[1:2] in (["-v"], ["-V"]):
        return []  # a lookup, not a run
    while words and words[0] in _WRAPPERS:
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0] or re.fullmatch(r"\d+[smh]?", words[0])):
            words = words[1:]
    if len(words) >= 3 and re.fullmatch(r"python(3(\.\d+)?)?", words[0]) and words[1:3] == ["-m", "pip"]:
        words = ["pip"] + words[3:]
    return words


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _only_logs(args: list[str]) -> bool:
    paths = [a for a in args if not a.startswith("-")][1:]  # the first: the mode or owner
    return bool(paths) and all(p == "/logs" or p.startswith("/logs/") for p in paths)


def _resolved(where: str, command: str, results: list[tuple[str | None, str]], packages=(), debian=()) -> Install:
    return Install(where, command, tuple(note for _, note in results), tuple(n for n, _ in results if n),
                   packages=tuple(packages), debian=tuple(debian))


def _python(requirement: str) -> tuple[str | None, str]:
    """A requirement the host has as asked, or one fetched at build time."""
    missing, note = host_tools.python_package(requirement)
    if missing is None and "asked)" not in note:
        return None, note
    if note.endswith("not a requirement glmjax can resolve"):
        return missing, note
    have = re.search(r": (\S+) present", note)
    host = f" (the host has {have.group(1)})" if have else ""
    return None, f"{requirement}: fetched from PyPI into the layer{host}"


def _debian(name: str, manager: str, path: str, python: list[str], debian: list[str]) -> tuple[str | None, str]:
    """A system package the host has, or one fetched at build time (into ``python`` or ``debian``)."""
    missing, note = host_tools.apt_package(name, path)
    if missing is None:
        return None, note
    if "$" in name:
        return name, f"{name}: a package named only when the script runs"
    pypi = host_tools.pypi_name(name.split("=")[0])
    if pypi:
        python.append(pypi)
        return None, f"{name}: PyPI's {pypi} fetched into the layer for the sandbox's python"
    debian.append(name)
    other = "" if manager in ("apt-get", "apt", "aptitude") else f" ({manager}'s name taken as Debian's)"
    return None, f"{name}: not on the host; Debian's package fetched into the layer{other}"


def _classify(words: list[str], where: str, command: str, path: str, read) -> Install | None:
    name, args = (words[0].rsplit("/", 1)[-1], words[1:]) if words else ("", [])
    if name in ("apt-get", "apt", "apk", "yum", "dnf", "microdnf", "aptitude"):
        packages = host_tools.apt_packages(args)
        if packages is None:
            return Install(where, command, (f"{name} {args[0] if args else ''}: the host's packages stand in",))
        python, debian = [], []
        results = [_debian(p, name, path, python, debian) for p in packages]
        return _resolved(where, command, results, python, debian)
    if name in ("pip", "pip3") or (name == "uv" and args[:2] == ["pip", "install"]):
        args = args[1:] if name == "uv" else args
        if args[:1] != ["install"]:
            return None
        reqs, sources = host_tools.pip_requirements(args[1:], read)
        results = [_python(r) for r in reqs]
        results += [(s, f"cannot install {s} without a network") for s in sources]
        return _resolved(where, command, results, reqs)
    if name == "uv" and args[:1] == ["add"]:
        reqs = [r for r in args[1:] if not r.startswith("-")]
        return _resolved(where, command, [_python(r) for r in reqs], reqs)
    if name == "uvx" or (name == "uv" and args[:1] == ["run"]) or (name == "uv" and args[:2] == ["tool", "run"]):
        args = args if name == "uvx" else args[1:] if args[:1] == ["run"] else args[2:]
        withs, rest = host_tools.uv_options(args)
        if not withs and not rest:
            return None
        results, withs = [_python(w) for w in withs], list(withs)
        asked = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-p", "--python")), None)
        if asked and not host_tools.same_python(asked):
            results.append((None, f"python {asked} asked; the sandbox's is {host_tools.PYTHON_VERSION}"))
        if rest:
            tool = re.split(r"[=<>@\[]", rest[0], maxsplit=1)[0]
            if tool in ("pytest", "py.test", "python", "python3") or host_tools.command(tool, path):
                results.append((None, f"{tool}: the sandbox's own"))
            elif name == "uv" and words[1:2] == ["run"]:  # a command of the project's environment
                results.append((tool, f"{tool} is not available in this sandbox"))
            else:  # uvx fetches the tool's package and runs its console script
                source = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--from"), None)
                withs.append(source or rest[0].replace("@", "==", 1))
                results.append((None, f"{tool}: {withs[-1]} fetched from PyPI into the layer"))
        return _resolved(where, command, results, withs)
    if name in ("cp", "mv", "ln", "install") and any(_UV_BINARY.search(a) for a in args if not a.startswith("-")):
        return Install(where, command, ("copies the installer's uv: uv and uvx are the sandbox's own",), replaced=True)
    if (name in ("ln", "cp") and args and _PYTHON_ALIAS.search(args[-1])) or (
            name == "update-alternatives" and any(_PYTHON_ALIAS.search(a) for a in args)):
        return Install(where, command, ("a python or pip alias: the sandbox's tools have both names",), replaced=True)
    if name in ("chmod", "chown", "chgrp") and _only_logs(args):
        return Install(where, command, ("the sandbox makes /logs and /logs/verifier itself",), replaced=True)
    if name in ("source", ".") and args and _ENV_FILE.search(args[0]):
        return Install(where, command, ("the uv installer's env file: uv and uvx are already on PATH",), replaced=True)
    if name == "rm" and any(_APT_CACHE.match(a) for a in args):
        return Install(where, command, ("apt's cache: nothing to clean",), replaced=True)
    if name in ("curl", "wget"):
        urls = [a for a in args if "://" in a and not _LOCAL_URL.match(a)]
        return Install(where, command, tuple(f"fetches {u} (the sandbox has no network)" for u in urls),
                       tuple(urls)) if urls else None
    if name == "git" and args[:1] == ["clone"]:
        urls = [a for a in args[1:] if "://" in a or a.startswith("git@")]
        return Install(where, command, tuple(f"clones {u} (the sandbox has no network)" for u in urls),
                       tuple(urls)) if urls else None
    if name in _NETWORK_INSTALLERS and (args[0] if args else "") in _NETWORK_INSTALLERS[name]:
        return Install(where, command, (f"{name} installs from the network",), (f"{name} {args[0] if args else ''}",))
    return None


def scan(script: str, where: str, *, path: str | None = None, read: Callable[[str], str | None] | None = None) -> Scan:
    """The install steps of ``script`` (see the module docstring). ``path``: the sandbox's
    PATH for command lookups; ``read``: reads files named by ``pip install -r``."""
    path = path or host_tools.SYSTEM_PATH
    read = read or (lambda _: None)
    installs, spans = [], []
    for pipeline in shell_syntax.pipelines(script):
        text = _short(script[pipeline.start:pipeline.end])
        commands = [_unwrap(c.words) for c in pipeline.commands]
        fetch = commands[0][:1] and commands[0][0] in ("curl", "wget")
        if fetch and len(commands) > 1 and commands[-1][:1] and commands[-1][0] in _SHELLS:
            if any(_UV_INSTALLER.search(w) for w in commands[0]):
                installs.append(Install(where, text, ("the uv installer: uv and uvx are the sandbox's own",),
                                        replaced=True))
                spans.append((pipeline.start, pipeline.end, "true"))
                continue
        for words, command in zip(commands, pipeline.commands):
            found = _classify(words, where, _short(script[command.start:command.end]), path, read)
            if found is None:
                continue
            installs.append(found)
            if found.replaced:
                spans.append((command.start, command.end, "true"))
    return Scan(shell_syntax.rewrite(script, spans), tuple(installs))
