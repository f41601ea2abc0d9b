"""A task's ``environment/Dockerfile``, emulated without Docker.

The host stands in for the base image (``FROM`` is recorded, not pulled; an official
language image's tools, such as ``go`` for ``golang``, must be on the host). What the
image adds is reproduced in a sandbox:

    WORKDIR      the working directory (the last one is the sandbox's ``/app``; before the
                 first, relative paths start at ``/``, as in Docker)
    COPY / ADD   local files and directories, with Docker's rules: a destination that
                 ends in ``/``, or names a directory made earlier, receives the sources
                 inside it; a single file to any other path is written at that path;
                 globs are expanded; a local tar archive given to ADD is unpacked. Files
                 land under the final working directory or under ``/tmp``
    ENV / ARG    variables (``$VAR`` / ``${VAR}`` expanded as Docker does; ``$PATH`` stays
                 for the sandbox to expand against its own PATH); build arguments are in
                 the environment of the RUN lines after them
    RUN          commands run in the sandbox before the agent starts, shell form or
                 exec form or a here-document; their install steps are resolved by
                 ``envs/image/installs.py`` (``pip install -r`` reads the files copied so far)
    USER, EXPOSE, CMD, ENTRYPOINT, LABEL, ...   recorded in ``notes``; nothing is started

What cannot be reproduced makes the task unsupported, with the reason: ``COPY --from`` a
build stage or image (uv's image aside: uv is the sandbox's own), ``ADD`` of a URL,
sources outside the build context, destinations outside the working directory and
``/tmp``, install steps or base-image tools the host cannot provide. A malformed file,
or one that ``docker build`` would fail on (a missing ``COPY`` source), raises
``DockerfileError`` naming the line.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import posixpath
import re
import shlex
import tarfile

from envs.image import host_tools, installs
from envs.sandbox import tree

_IGNORED = {"EXPOSE", "CMD", "ENTRYPOINT", "LABEL", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "VOLUME", "ONBUILD",
            "MAINTAINER", "USER"}
_UV_IMAGE = re.compile(r"(^|/)astral-sh/uv(:|@|$)")
_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)(?::?[-+][^}]*)?\}|([A-Za-z_]\w*))")


class DockerfileError(ValueError):
    """The Dockerfile cannot be read (a malformed instruction); the message names the line."""


@dataclasses.dataclass
class Image:
    """What the emulated build produced. ``files``: the working directory's contents,
    paths relative to it; ``tmp_files``: what it put under ``/tmp`` (relative to it);
    ``setup``: the RUN commands as written (``envs/harbor/task.py`` resolves their install
    steps when it runs them); ``installs``: how they resolve."""

    workdir: str = "/app"
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    tmp_files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    setup: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    installs: list[installs.Install] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    unsupported: str | None = None

    def refuse(self, reason: str) -> None:
        self.unsupported = self.unsupported or reason


def _expand(text: str, values: dict[str, str]) -> str:
    def one(m):
        name = m.group(1) or m.group(2)
        return values[name] if name in values and name != "PATH" else m.group(0)
    return _VAR.sub(one, text)


def _instructions(text: str):
    """(line number, instruction, argument): continuations joined, comments dropped,
    ``RUN <<EOF`` here-documents gathered into the argument."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            nxt = lines[i]
            i += 1
            if nxt.lstrip().startswith("#"):
                continue
            line = line.rstrip()[:-1] + nxt  # Docker drops the escape and the newline
        op, _, arg = line.strip().partition(" ")
        heredoc = re.match(r"\s*<<-?\s*(['\"]?)(\w+)\1\s*$", arg)
        if heredoc:
            body = []
            while i < len(lines) and lines[i].strip() != heredoc.group(2):
                body.append(lines[i])
                i += 1
            i += 1
            arg = "\n".join(body) + "\n"
        yield number, op.upper(), arg.strip() if not heredoc else arg


def emulate(path: str, where: str = "environment/Dockerfile") -> Image:
    """The image ``path`` (a Dockerfile) builds, as far as a sandbox can reproduce it;
    ``where`` names the file in messages."""
    image = Image()
    if not os.path.isfile(path):
        return image
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    context = os.path.dirname(path)
    placed: dict[str, tuple[bytes, str]] = {}  # absolute path in the image -> (bytes, the line that put it)
    dirs: set[str] = set()
    cwd, args, stages = "/", {}, 0  # Docker's working directory until the first WORKDIR is /
    for number, op, arg in _instructions(text):
        at = f"{where} line {number}"
        values = {**args, **image.env}
        if op == "FROM":
            stages += 1
            base = arg.split()[0] if arg.split() else ""
            if not base:
                raise DockerfileError(f"{at}: FROM needs an image")
            if stages > 1:  # a multi-stage build: only the last stage is the task's image
                placed, dirs, image.setup, image.installs = {}, set(), [], []
            _base_image(image, _expand(base, values), at)
        elif op == "WORKDIR":
            if not arg:
                raise DockerfileError(f"{at}: WORKDIR needs a path")
            cwd = posixpath.normpath(posixpath.join(cwd, _expand(arg, values)))
            image.workdir = cwd
            dirs.add(cwd)
        elif op in ("ENV", "ARG"):
            pairs = _assignments(arg, op, at)
            target = image.env if op == "ENV" else args
            for key, value in pairs:
                target[key] = _expand(value, values)
        elif op in ("COPY", "ADD"):
            _copy(image, op, _expand(arg, values), context, cwd, placed, dirs, at)
        elif op == "RUN":
            command = _run_command(arg, at)
            read = lambda p, c=cwd: _placed_text(placed, posixpath.join(c, p))  # noqa: E731  pip -r files
            found = installs.scan(_expand(command, values), at, read=read)
            image.installs += found.installs
            if found.unsupported:
                image.refuse(found.unsupported)
            exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in args.items() if k not in image.env)
            image.setup.append(exports + command)  # build arguments are the RUN's environment
        elif op in _IGNORED:
            if op in ("CMD", "ENTRYPOINT", "USER"):
                image.notes.append(f"{op} {arg}: not applied (commands run as the sandbox's user; nothing is started)")
        else:
            raise DockerfileError(f"{at}: unknown instruction {op!r}")
    _settle(image, placed)
    return image


def _placed_text(placed: dict, path: str) -> str | None:
    found = placed.get(posixpath.normpath(path))
    return found[0].decode(errors="replace") if found else None


def _settle(image: Image, placed: dict[str, tuple[bytes, str]]) -> None:
    """Files land where the final working directory (the sandbox's ``/app``) or ``/tmp``
    puts them; anywhere else cannot be reproduced."""
    for path, (data, at) in sorted(placed.items()):
        for top, target in ((image.workdir, image.files), ("/tmp", image.tmp_files)):
            if path.startswith(top.rstrip("/") + "/"):
                target[posixpath.relpath(path, top)] = data
                break
        else:
            image.refuse(f"{at}: copies {path}, outside the working directory {image.workdir} and /tmp")


# The commands an official base image brings, which the host must have in its place.
_BASE_TOOLS = {"golang": ("go",), "node": ("node", "npm"), "openjdk": ("java",), "eclipse-temurin": ("java",),
               "amazoncorretto": ("java",), "maven": ("mvn", "java"), "gradle": ("gradle", "java"),
               "rust": ("cargo", "rustc"), "ruby": ("ruby",), "php": ("php",), "perl": ("perl",),
               "gcc": ("gcc", "g++"), "swift": ("swift",), "haskell": ("ghc",), "julia": ("julia",),
               "r-base": ("R",), "r-ver": ("R",), "elixir": ("elixir",), "erlang": ("erl",), "sdk": ("dotnet",),
               "denoland/deno": ("deno",), "oven/bun": ("bun",), "postgres": ("postgres",), "redis": ("redis-server",),
               "mysql": ("mysqld",), "mongo": ("mongod",), "nginx": ("nginx",)}


def _base_image(image: Image, base: str, at: str) -> None:
    repo = base.split("@")[0].rsplit(":", 1)[0] if ":" in base.split("/")[-1] else base.split("@")[0]
    name = repo.split("/")[-1]
    tools = _BASE_TOOLS.get(name) or _BASE_TOOLS.get("/".join(repo.split("/")[-2:]), ())
    missing = [t for t in tools if host_tools.command(t, host_tools.SYSTEM_PATH) is None]
    if missing:
        image.refuse(f"{at}: FROM {base}: the base image provides {', '.join(missing)}, which this host lacks")
    version = re.match(r"python:(\d+\.\d+)", base.split("/")[-1])
    if version and not host_tools.same_python(version.group(1)):
        image.notes.append(f"FROM {base}: the host stands in for the base image (python "
                           f"{host_tools.PYTHON_VERSION} in place of {version.group(1)})")
    else:
        image.notes.append(f"FROM {base}: the host stands in for the base image")


def _assignments(arg: str, op: str, at: str) -> list[tuple[str, str]]:
    try:
        words = shlex.split(arg)
    except ValueError as err:
        raise DockerfileError(f"{at}: {op} {arg!r}: {err}") from None
    if op == "ENV" and words and "=" not in words[0]:
        if len(words) < 2:
            raise DockerfileError(f"{at}: ENV {arg!r} needs a value")
        return [(words[0], arg.split(None, 1)[1].strip().strip('"'))]
    pairs = []
    for word in words:
        key, eq, value = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_]\w*", key) or (op == "ENV" and not eq):
            raise DockerfileError(f"{at}: {op} {word!r} is not NAME=value")
        pairs.append((key, value))
    return pairs


def _run_command(arg: str, at: str) -> str:
    if arg.startswith("["):
        try:
            words = json.loads(arg)
        except json.JSONDecodeError as err:
            raise DockerfileError(f"{at}: RUN exec form is not a JSON list: {err}") from None
        return shlex.join(words)
    words = arg.split()
    while words and words[0].startswith("--"):  # RUN --mount=... --network=...
        arg = arg.split(None, 1)[1] if len(arg.split(None, 1)) > 1 else ""
        words = words[1:]
    return arg


def _copy(image: Image, op: str, arg: str, context: str, cwd: str, placed: dict, dirs: set, at: str) -> None:
    try:
        words = json.loads(arg) if arg.startswith("[") else shlex.split(arg)
    except (ValueError, json.JSONDecodeError) as err:
        raise DockerfileError(f"{at}: {op} {arg!r}: {err}") from None
    flags = [w for w in words if w.startswith("--")]
    words = [w for w in words if not w.startswith("--")]
    if len(words) < 2:
        raise DockerfileError(f"{at}: {op} needs a source and a destination, got {arg!r}")
    source_image = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
    if source_image is not None and _UV_IMAGE.search(source_image):
        image.notes.append(f"{at}: {op} --from={source_image}: uv and uvx are the sandbox's own")
        return
    if source_image is not None:
        image.refuse(f"{at}: {op} --from a build stage or image needs Docker: {arg!r}")
        return
    if any("://" in w for w in words[:-1]):
        image.refuse(f"{at}: {op} of a URL needs the network: {arg!r}")
        return
    raw_dest = words[-1]
    dest = posixpath.normpath(posixpath.join(cwd, raw_dest))
    sources = []
    for src in words[:-1]:
        matches = sorted(glob.glob(os.path.join(context, src))) if glob.has_magic(src) else [os.path.join(context, src)]
        for full in matches:
            full = os.path.normpath(full)
            if full != os.path.normpath(context) and not full.startswith(os.path.normpath(context) + os.sep):
                image.refuse(f"{at}: {op} source {src!r} is outside the build context")
                return
            if not os.path.exists(full):  # docker build fails here too: the task is broken
                raise DockerfileError(f"{at}: {op} source {src!r} is not in the build context {context}")
            sources.append(full)
    into = raw_dest.endswith("/") or dest in dirs or len(sources) > 1 or any(os.path.isdir(s) for s in sources)
    for full in sources:
        if os.path.isdir(full):
            for rel, data in tree.read_tree(full).items():
                _put(placed, dirs, posixpath.join(dest, rel), data, at)
        elif op == "ADD" and tarfile.is_tarfile(full):
            with tarfile.open(full) as archive:
                for member in archive.getmembers():
                    if member.isfile():
                        name = posixpath.normpath(member.name)
                        if name.startswith(("../", "/")):
                            image.refuse(f"{at}: ADD archive member {member.name!r} leaves the destination")
                            return
                        _put(placed, dirs, posixpath.join(dest, name), archive.extractfile(member).read(), at)
        else:
            with open(full, "rb") as f:
                data = f.read()
            _put(placed, dirs, posixpath.join(dest, os.path.basename(full)) if into else dest, data, at)
    if into:
        dirs.add(dest)


def _put(placed: dict, dirs: set, path: str, data: bytes, at: str) -> None:
    path = posixpath.normpath(path)
    if path in dirs:
        raise DockerfileError(f"{at}: a file cannot replace the directory {path}")
    placed[path] = (data, at)
    parent = posixpath.dirname(path)
    while parent not in ("/", ""):
        dirs.add(parent)
        parent = posixpath.dirname(parent)
