"""A task's ``environment/Dockerfile``, emulated without Docker.

The host stands in for the base image (``FROM`` is recorded, not pulled). What the image
adds is reproduced in a sandbox:

    WORKDIR      the working directory (the sandbox's ``/app`` stands for it)
    COPY / ADD   local files and directories into the working directory, with Docker's
                 rules: a destination that ends in ``/``, names the working directory or
                 a directory made earlier receives the sources inside it; a single file
                 to any other path is written at that path; globs are expanded; a local
                 tar archive given to ADD is unpacked
    ENV / ARG    variables for the commands (``$VAR`` / ``${VAR}`` expanded as Docker does;
                 ``$PATH`` stays for the sandbox to expand against its own PATH)
    RUN          commands run in the sandbox before the agent starts, shell form or
                 exec form or a here-document; their install steps are resolved by
                 ``envs/installs.py``
    USER, EXPOSE, CMD, ENTRYPOINT, LABEL, ...   recorded in ``notes``; nothing is started

What cannot be reproduced makes the task unsupported, with the reason: ``COPY --from`` a
build stage, ``ADD`` of a URL, sources outside the build context, destinations outside
the working directory, install steps the host cannot satisfy. A malformed file raises
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

from envs import installs, tree

_IGNORED = {"EXPOSE", "CMD", "ENTRYPOINT", "LABEL", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "VOLUME", "ONBUILD",
            "MAINTAINER", "USER"}
_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)(?::?[-+][^}]*)?\}|([A-Za-z_]\w*))")


class DockerfileError(ValueError):
    """The Dockerfile cannot be read (a malformed instruction); the message names the line."""


@dataclasses.dataclass
class Image:
    """What the emulated build produced. ``files``: the working directory's contents,
    paths relative to it; ``setup``: the RUN commands as written (``envs/harbor.py``
    resolves their install steps when it runs them); ``installs``: how they resolve."""

    workdir: str = "/app"
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
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


def emulate(path: str) -> Image:
    """The image ``path`` (a Dockerfile) builds, as far as a sandbox can reproduce it."""
    image = Image()
    if not os.path.isfile(path):
        return image
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    context, where = os.path.dirname(path), "environment/Dockerfile"
    dirs = {image.workdir}
    args: dict[str, str] = {}
    stages = 0
    for number, op, arg in _instructions(text):
        at = f"{where} line {number}"
        values = {**args, **image.env}
        if op == "FROM":
            stages += 1
            base = arg.split()[0] if arg.split() else ""
            if not base:
                raise DockerfileError(f"{at}: FROM needs an image")
            if stages > 1:  # a multi-stage build: only the last stage is the task's image
                image.files, image.setup, dirs = {}, [], {image.workdir}
            image.notes.append(f"FROM {base}: the host stands in for the base image")
        elif op == "WORKDIR":
            if not arg:
                raise DockerfileError(f"{at}: WORKDIR needs a path")
            image.workdir = posixpath.normpath(posixpath.join(image.workdir, _expand(arg, values)))
            dirs.add(image.workdir)
        elif op in ("ENV", "ARG"):
            pairs = _assignments(arg, op, at)
            target = image.env if op == "ENV" else args
            for key, value in pairs:
                target[key] = _expand(value, values)
        elif op in ("COPY", "ADD"):
            _copy(image, op, _expand(arg, values), context, dirs, at)
        elif op == "RUN":
            command = _run_command(arg, at)
            found = installs.scan(command, at)
            image.installs += found.installs
            if found.unsupported:
                image.refuse(found.unsupported)
            image.setup.append(command)
        elif op in _IGNORED:
            if op in ("CMD", "ENTRYPOINT", "USER"):
                image.notes.append(f"{op} {arg}: not applied (commands run as the sandbox's user; nothing is started)")
        else:
            raise DockerfileError(f"{at}: unknown instruction {op!r}")
    return image


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


def _copy(image: Image, op: str, arg: str, context: str, dirs: set[str], at: str) -> None:
    try:
        words = json.loads(arg) if arg.startswith("[") else shlex.split(arg)
    except (ValueError, json.JSONDecodeError) as err:
        raise DockerfileError(f"{at}: {op} {arg!r}: {err}") from None
    flags = [w for w in words if w.startswith("--")]
    words = [w for w in words if not w.startswith("--")]
    if len(words) < 2:
        raise DockerfileError(f"{at}: {op} needs a source and a destination, got {arg!r}")
    if any(f.startswith("--from") for f in flags):
        image.refuse(f"{at}: {op} --from a build stage or image needs Docker: {arg!r}")
        return
    if any("://" in w for w in words[:-1]):
        image.refuse(f"{at}: {op} of a URL needs the network: {arg!r}")
        return
    raw_dest = words[-1]
    dest = posixpath.normpath(posixpath.join(image.workdir, raw_dest))
    workdir = image.workdir
    if dest != workdir and not dest.startswith(workdir + "/"):
        image.refuse(f"{at}: {op} to {dest}, outside the working directory {workdir}")
        return
    sources = []
    for src in words[:-1]:
        matches = sorted(glob.glob(os.path.join(context, src))) if glob.has_magic(src) else [os.path.join(context, src)]
        for full in matches:
            full = os.path.normpath(full)
            if full != os.path.normpath(context) and not full.startswith(os.path.normpath(context) + os.sep):
                image.refuse(f"{at}: {op} source {src!r} is outside the build context")
                return
            if not os.path.exists(full):
                image.refuse(f"{at}: {op} source {src!r} not found in {context}")
                return
            sources.append(full)
    into = raw_dest.endswith("/") or dest in dirs or len(sources) > 1 or any(os.path.isdir(s) for s in sources)
    rel_dest = posixpath.relpath(dest, workdir)
    for full in sources:
        if os.path.isdir(full):
            for rel, data in tree.read_tree(full).items():
                _put(image, dirs, posixpath.join(rel_dest, rel), data, workdir)
        elif op == "ADD" and tarfile.is_tarfile(full):
            with tarfile.open(full) as archive:
                for member in archive.getmembers():
                    if member.isfile():
                        name = posixpath.normpath(member.name)
                        if name.startswith(("../", "/")):
                            image.refuse(f"{at}: ADD archive member {member.name!r} leaves the destination")
                            return
                        _put(image, dirs, posixpath.join(rel_dest, name), archive.extractfile(member).read(), workdir)
        else:
            with open(full, "rb") as f:
                data = f.read()
            target = posixpath.join(rel_dest, os.path.basename(full)) if into else rel_dest
            _put(image, dirs, target, data, workdir)
    if into:
        dirs.add(dest)


def _put(image: Image, dirs: set[str], rel: str, data: bytes, workdir: str) -> None:
    rel = posixpath.normpath(rel)
    if rel in (".", ""):
        raise DockerfileError(f"a file cannot replace the working directory {workdir}")
    image.files[rel] = data
    parent = posixpath.dirname(rel)
    while parent:
        dirs.add(posixpath.join(workdir, parent))
        parent = posixpath.dirname(parent)
