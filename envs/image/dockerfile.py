"""A Dockerfile read by Docker's own grammar: what each stage's instructions say, with
variables substituted as Docker substitutes them. Building is ``envs/image/build.py``'s.

The instructions come from the ``dockerfile`` package, which wraps the parser of
moby/buildkit (line continuations, comments, the ``escape`` directive, here-documents,
exec and shell forms are Docker's). On top of it, what BuildKit does before a build:

- stages: ``FROM image [AS name]`` starts one; a stage built on an earlier one (``FROM
  name``) starts from its variables, working directory, user and shell;
- variables: ``ARG`` (before the first ``FROM``: for ``FROM`` lines only) and ``ENV``,
  substituted in the instructions Docker substitutes (``ADD COPY ENV EXPOSE FROM LABEL
  STOPSIGNAL USER VOLUME WORKDIR``, ``ARG`` defaults), with its forms ``$v ${v}
  ${v:-word} ${v-word} ${v:+word} ${v+word}``, quotes and escapes. ``$PATH`` before any
  ``ENV PATH`` stays as written: the base image's PATH is whatever stands in for it;
- ``RUN``: the script its shell gets (``SHELL``, default ``/bin/sh -c``), here-documents
  included; the exec form as a quoted command line; the variables in effect (``ARG`` and
  ``ENV``), working directory and user;
- ``WORKDIR`` relative to the one before (``/`` at first), ``COPY``/``ADD`` destinations
  made absolute, their flags (``--from``, ``--chown``, ``--chmod``) as a mapping.

A line Docker would reject (an unknown instruction, a malformed ``ENV``, a ``FROM``
without an image) raises ``DockerfileError`` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import shlex
from typing import Mapping


_KNOWN = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL", "MAINTAINER",
          "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class DockerfileError(ValueError):
    """The Dockerfile is one Docker would reject; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a stage. ``words``: its arguments, substituted where Docker
    substitutes; ``flags``: ``--name=value`` options; ``script``: for ``RUN``, what the
    shell runs; ``heredocs``: (name, body) of each here-document; ``env``, ``cwd``,
    ``user``, ``shell``: what is in effect for it."""

    op: str
    words: tuple[str, ...]
    flags: Mapping[str, str]
    where: str
    script: str = ""
    heredocs: tuple[tuple[str, str], ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cwd: str = "/"
    user: str = ""
    shell: tuple[str, ...] = ("/bin/sh", "-c")


@dataclasses.dataclass(frozen=True)
class Stage:
    """A build stage: its base (an image, or ``stage:N`` for the earlier stage N), its name,
    its instructions, and what its image ends with: ``env`` (``ENV`` only), ``workdir``, ``user``."""

    base: str
    name: str | None
    where: str
    steps: tuple[Instruction, ...]
    env: Mapping[str, str]
    workdir: str
    user: str


def substitute(word: str, values: Mapping[str, str], keep: tuple[str, ...] = ("PATH",)) -> str:
    """``word`` as Docker's shell lexer processes it: quotes removed, escapes applied,
    variables substituted (names in ``keep`` that have no value stay as written)."""
    out, i, quote = [], 0, None
    while i < len(word):
        c = word[i]
        if quote == "'":
            if c == "'":
                quote = None
            else:
                out.append(c)
            i += 1
        elif c == "\\" and i + 1 < len(word) and (quote is None or word[i + 1] in '"\\$'):
            out.append(word[i + 1])
            i += 2
        elif c in "'\"" and quote is None:
            quote = c
            i += 1
        elif c == '"' and quote == '"':
            quote = None
            i += 1
        elif c == "$":
            text, i = _variable(word, i, values, keep)
            out.append(text)
        else:
            out.append(c)
            i += 1
    if quote:
        raise ValueError(f"unterminated {quote} quote in {word!r}")
    return "".join(out)


def _variable(word: str, i: int, values: Mapping[str, str], keep: tuple[str, ...]) -> tuple[str, int]:
    """The substitution of the variable at ``word[i]`` ('$'), and where the word goes on."""
    plain = _NAME.match(word, i + 1)
    if plain:
        name = plain.group(0)
        return (values[name] if name in values else word[i:plain.end()] if name in keep else ""), plain.end()
    if not word.startswith("${", i):
        return "$", i + 1
    depth, j = 1, i + 2
    while j < len(word) and depth:
        depth += {"{": 1, "}": -1}.get(word[j], 0)
        j += 1
    if depth:
        raise ValueError(f"unterminated ${{ in {word!r}")
    body = word[i + 2:j - 1]
    found = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+?])(.*))?", body, re.S)
    if not found:
        raise ValueError(f"bad substitution ${{{body}}}")
    name, op, arg = found.groups()
    value = values.get(name)
    is_set = value is not None and (value != "" or not op or not op.startswith(":"))
    if op is None:
        text = value if value is not None else (word[i:j] if name in keep else "")
    elif op.endswith("-"):
        text = value if is_set else substitute(arg, values, keep)
    elif op.endswith("+"):
        text = substitute(arg, values, keep) if is_set else ""
    else:
        if not is_set:
            raise ValueError(f"{name}: {arg or 'parameter not set'}")
        text = value
    return text, j


def _pairs(command, values: Mapping[str, str], at: str) -> list[tuple[str, str | None]]:
    """``ENV``/``ARG`` assignments: (name, value; None for an ``ARG`` without a default)."""
    if command.cmd == "ENV":
        words = list(command.value)
        if len(words) % 2:
            raise DockerfileError(f"{at}: ENV {command.original[4:]!r} needs name=value pairs")
        return [(words[k], substitute(words[k + 1], values)) for k in range(0, len(words), 2)]
    pairs = []
    for word in command.value:
        name, eq, default = word.partition("=")
        if not _NAME.fullmatch(name):
            raise DockerfileError(f"{at}: ARG {word!r} is not NAME or NAME=default")
        pairs.append((name, substitute(default, values) if eq else None))
    return pairs


def _run_script(command) -> str:
    """What ``RUN``'s shell gets: the command line, or a lone here-document's body, with
    the bodies of the here-documents it feeds after it, as a shell script holds them."""
    if command.json:
        return shlex.join(command.value)
    text = " ".join(command.value)
    docs = command.heredocs
    if len(docs) == 1 and re.fullmatch(r"\d*<<-?([\"']?)" + re.escape(docs[0].name) + r"\1", text.strip()):
        return docs[0].content
    return text + "".join(f"\n{d.content}{d.name}" for d in docs)


def read(path: str, where: str = "Dockerfile") -> tuple[Stage, ...]:
    """The stages of the Dockerfile at ``path``; ``where`` names it in messages."""
    # imported here: the parser is Go's, whose runtime reserves some 770 MB of address space in every process
    # that loads it, and many import envs (a sympy worker under RLIMIT_AS among them) without reading a Dockerfile
    import dockerfile as buildkit

    try:
        commands = buildkit.parse_file(path)
    except buildkit.GoParseError as err:
        raise DockerfileError(f"{where}: {err}") from None
    stages: list[Stage] = []
    global_args: dict[str, str] = {}
    current = None  # the stage being read: a dict of its parts

    def close() -> None:
        if current is not None:
            stages.append(Stage(current["base"], current["name"], current["where"], tuple(current["steps"]),
                                dict(current["env"]), current["cwd"], current["user"]))

    for command in commands:
        at, op = f"{where} line {command.start_line}", command.cmd.upper()
        if op not in _KNOWN:
            raise DockerfileError(f"{at}: unknown instruction {command.cmd!r}")
        try:
            if op == "FROM":
                close()
                current = _start(command, stages, global_args, at)
                continue
            if current is None:
                if op != "ARG":
                    raise DockerfileError(f"{at}: {op} before the first FROM")
                global_args.update({k: v or "" for k, v in _pairs(command, global_args, at)})
                continue
            values = {**current["args"], **current["env"]}
            step = _step(command, op, current, values, at)
            if step is not None:
                current["steps"].append(step)
        except ValueError as err:
            if isinstance(err, DockerfileError):
                raise
            raise DockerfileError(f"{at}: {err}") from None
    close()
    if not stages:
        raise DockerfileError(f"{where}: no FROM instruction")
    return tuple(stages)


def _start(command, stages: list[Stage], global_args: dict, at: str) -> dict:
    words = [w for w in command.value]
    if not words:
        raise DockerfileError(f"{at}: FROM needs an image")
    name = words[2].lower() if len(words) == 3 and words[1].upper() == "AS" else None
    if len(words) not in (1, 3) or (len(words) == 3 and name is None):
        raise DockerfileError(f"{at}: FROM {' '.join(words)!r} is not FROM image [AS name]")
    base = substitute(words[0], global_args)
    earlier = next((k for k, s in enumerate(stages) if s.name == base.lower()), None)
    part = {"name": name, "where": at, "steps": [], "args": {}, "env": {}, "cwd": "/", "user": "",
            "shell": ("/bin/sh", "-c"), "base": base, "globals": global_args}
    if earlier is not None:  # built on an earlier stage: its image is where this one starts
        before = stages[earlier]
        part.update(base=f"stage:{earlier}", env=dict(before.env), cwd=before.workdir, user=before.user)
        part["shell"] = next((s.shell for s in reversed(before.steps)), part["shell"])
    return part


def _step(command, op: str, stage: dict, values: dict, at: str) -> Instruction | None:
    flags = dict(f[2:].split("=", 1) if "=" in f else (f[2:], "") for f in command.flags)
    common = {"flags": flags, "where": at, "env": dict(values), "cwd": stage["cwd"], "user": stage["user"],
              "shell": stage["shell"]}
    if op in ("ENV", "ARG"):
        for name, value in _pairs(command, values, at):
            if op == "ENV":
                stage["env"][name] = value
            elif value is not None:
                stage["args"][name] = value
            elif name in stage["globals"]:  # a global ARG, declared again to be used in the stage
                stage["args"][name] = stage["globals"][name]
        return None
    if op == "WORKDIR":
        if not command.value:
            raise DockerfileError(f"{at}: WORKDIR needs a path")
        stage["cwd"] = posixpath.normpath(posixpath.join(stage["cwd"], substitute(command.value[0], values)))
        return Instruction(op, (stage["cwd"],), **{**common, "cwd": stage["cwd"]})
    if op == "USER":
        if not command.value:
            raise DockerfileError(f"{at}: USER needs a user")
        stage["user"] = substitute(command.value[0], values)
        return Instruction(op, (stage["user"],), **common)
    if op == "SHELL":
        if not command.json or not command.value:
            raise DockerfileError(f"{at}: SHELL needs a JSON list, such as [\"/bin/bash\", \"-c\"]")
        stage["shell"] = tuple(command.value)
        return None
    if op == "RUN":
        if not command.value and not command.heredocs:
            raise DockerfileError(f"{at}: RUN needs a command")
        return Instruction(op, tuple(command.value), script=_run_script(command),
                           heredocs=tuple((d.name, d.content) for d in command.heredocs), **common)
    if op in ("COPY", "ADD"):
        words = [w if command.json else substitute(w, values) for w in command.value]
        if len(words) < 2:
            raise DockerfileError(f"{at}: {op} needs a source and a destination, got {command.original!r}")
        if "chown" in flags:
            flags["chown"] = substitute(flags["chown"], values)
        return Instruction(op, tuple(words), heredocs=tuple((d.name, d.content) for d in command.heredocs),
                           **common)
    words = tuple(command.value) if command.json else tuple(substitute(w, values) for w in command.value)
    return Instruction(op, words, **common)
