"""A task's image, built once from its Dockerfile into a layer and cached on the machine.

``build(source)`` (``envs/image/context.py`` finds the source) runs the Dockerfile's stages
(``envs/image/dockerfile.py`` reads them) as Docker would, over the host, which stands in
for the base image:

    FROM          the host, with what ``packages.base_image`` installs in the layer for the
                  base's toolchain (``golang:1.22``: Debian's Go); an earlier stage: a copy of
                  its layer
    RUN           its install steps (``apt-get install``, ``pip install``, ``uv pip
                  install``) are done outside, through the registries, by
                  ``envs/image/packages.py``, and taken out of the script; the rest runs as
                  root in the build sandbox (``envs/sandbox/build.py``), whose writes land in
                  the layer, anywhere in the tree
    COPY / ADD    Docker's rules (a directory's contents, a destination that ends in ``/``
                  or is a directory, globs, ``--chown``, ``--chmod``, ADD's local archives,
                  here-documents, ``--from`` an earlier stage), copied inside the build
                  sandbox from a read-only view of the sources, anywhere in the tree
    WORKDIR       made in the layer; ENV, ARG, USER (later RUN lines run as that user), SHELL
                  as in Docker

The image's working directory (its last ``WORKDIR``, or the task's ``workdir``) becomes the
sandbox's ``/app`` and ``/tmp`` its ``/tmp``: their contents are moved out of the layer into
``app/`` and ``tmp/``, which every episode copies; the rest of the layer is laid read-only
over each sandbox's root (``envs/sandbox/layers.py``).

Cache: ``cache_dir()`` (default ``~/.cache/glmjax/images``), one directory per key,
the hash of the Dockerfile, the files of the context a build sees, the working directory
and this builder's own files (so a change to the builder rebuilds). Each holds ``layer/``,
``app/``, ``tmp/`` and ``image.json``; a build runs in a staging directory under a lock,
and is renamed into place when it is done, so episodes only ever see finished layers.
What cannot be reproduced (an ``ADD`` of a URL, ``COPY --from`` an image, a step that
fails here) is cached too: the image is ``unsupported``, naming the file, line and step.
Every deviation from Docker (the base's stand-in, a version, ``USER``, ``CMD``) is in
``notes``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import posixpath
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile

from envs.image import context as contexts
from envs.image import dockerfile, host_tools, packages, shell_syntax
from envs.sandbox import tree
from envs.sandbox.build import BuildRoot
from envs.sandbox.sandbox import TOOLS, SandboxError

_DOCKER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_IN, _OUT = "/.glmjax-in", "/.glmjax-out"  # the sources of a COPY, and what a stage copies out
_UV_IMAGE = re.compile(r"(^|/)astral-sh/uv(:|@|$)")
_WRAPPERS = {"sudo", "env", "command", "exec", "nice", "nohup", "time", "stdbuf", "timeout"}
_NOTED = {"CMD", "ENTRYPOINT", "HEALTHCHECK", "ONBUILD", "VOLUME"}
_PLAIN_ENTRY = {"bash", "sh", "dash", "zsh", "tini", "dumb-init", "-c", "--", "-l", "-s"}  # start nothing of their own
# the builder's version: every file of this folder (the reader, the fetchers, the stand-ins) and the build sandbox
_BUILDER_FILES = (*sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "*.py"))),
                  sys.modules[BuildRoot.__module__].__file__)


class BuildError(dockerfile.DockerfileError):
    """``docker build`` would fail too (a ``COPY`` source that is not there): the task is broken."""


@dataclasses.dataclass(frozen=True)
class Image:
    """A built image. ``path``: its cache directory (``layer/``, ``app/``, ``tmp/``), None
    for a task without a Dockerfile; ``workdir``, ``env`` (``$PATH`` as written), ``user``;
    ``notes``: every way it differs from Docker's; ``installs``: how each install step was
    done; ``unsupported``: the step that cannot be reproduced."""

    path: str | None
    workdir: str = "/app"
    env: dict = dataclasses.field(default_factory=dict)
    user: str = ""
    notes: tuple[str, ...] = ()
    installs: tuple[dict, ...] = ()
    unsupported: str | None = None

    @property
    def layer(self) -> str | None:
        """The layer, or None when the build left nothing outside the working directory and /tmp."""
        layer = os.path.join(self.path, "layer") if self.path else None
        return layer if layer and os.listdir(layer) else None

    def contents(self, part: str) -> tuple[dict[str, bytes], dict[str, int]]:
        """What the image holds in ``app`` (its working directory) or ``tmp``: its regular
        files by path relative to it, and the permission bits of its files and directories
        (a directory's path ends in "/")."""
        top = os.path.join(self.path, part) if self.path else None
        files, modes = {}, {}
        for entry in tree.walk(top) if top and os.path.isdir(top) else ():
            if entry.is_dir:
                modes[entry.path + "/"] = stat.S_IMODE(entry.stat.st_mode) & 0o777
            elif stat.S_ISREG(entry.stat.st_mode):
                files[entry.path] = entry.read()
                modes[entry.path] = stat.S_IMODE(entry.stat.st_mode) & 0o777
        return files, modes


def cache_dir() -> str:
    """``$GLMJAX_IMAGE_CACHE``, else ``images`` in the machine's glmjax cache (``$GLMJAX_CACHE``,
    default ``~/.cache/glmjax``, where ``envs/image/packages.py`` keeps its downloads)."""
    root = os.environ.get("GLMJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "glmjax")
    return os.environ.get("GLMJAX_IMAGE_CACHE") or os.path.join(root, "images")


def _builder_version() -> str:
    h = hashlib.sha256(sys.version.encode())
    for path in _BUILDER_FILES:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def build(source: contexts.Source, workdir: str | None = None,
          also: tuple[list[str], list[str]] = ([], [])) -> Image:
    """The image of ``source``, from the cache or built now (see the module docstring);
    ``workdir``: the task's own (``[environment] workdir``), over the Dockerfile's;
    ``also``: (python requirements, Debian packages) the task's other scripts install
    (``installs.wanted``), fetched into the image's layer after its last step."""
    if source.dockerfile is None:
        return Image(None, workdir or "/app", unsupported=source.unsupported,
                     notes=("no Dockerfile: the host stands in for the image as it is",))
    stages = dockerfile.read(source.dockerfile, source.where)
    what = f"{_builder_version()}\0{contexts.digest(source)}\0{workdir}\0{also}"
    key = hashlib.sha256(what.encode()).hexdigest()[:24]
    root = cache_dir()
    entry = os.path.join(root, key)
    os.makedirs(root, mode=0o755, exist_ok=True)
    with open(os.path.join(root, f".{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build of a key at a time, on the whole machine
        if not os.path.isfile(os.path.join(entry, "image.json")):
            staging = tempfile.mkdtemp(prefix=f".{key}.", dir=root)
            try:
                os.chmod(staging, 0o755)
                image = _Build(source, stages, staging).run(workdir, also)
                with open(os.path.join(staging, "image.json"), "w") as f:
                    json.dump(dataclasses.asdict(image), f, indent=1)
                tree.rmtree(entry)  # a directory left without its image.json by a killed build
                os.rename(staging, entry)
            finally:
                tree.rmtree(staging)
    with open(os.path.join(entry, "image.json")) as f:
        fields = json.load(f)
    return Image(**{**fields, "path": entry, "notes": tuple(fields["notes"]), "installs": tuple(fields["installs"])})


class _Unsupported(Exception):
    """A step that cannot be reproduced here: the build stops, the image says why."""


class _Build:
    """One build in ``staging``: a layer per stage it needs, the last one the image's."""

    def __init__(self, source: contexts.Source, stages: tuple[dockerfile.Stage, ...], staging: str):
        self.source, self.stages, self.staging = source, stages, staging
        self.work = os.path.join(staging, "work")  # layers of earlier stages, sandboxes' scratch: removed after
        self.layers: dict[int, str] = {}
        self.roots: dict[int, BuildRoot] = {}
        self.notes: list[str] = []
        self.installs: list[dict] = []
        self.visible = self._context_files()

    def _context_files(self) -> list[str]:
        return [e.path + ("/" if e.is_dir else "") for e in tree.walk(self.source.context)
                if not contexts.ignored(e.path, self.source.ignore)]

    def run(self, workdir: str | None, also: tuple[list[str], list[str]]) -> Image:
        last = len(self.stages) - 1
        final = self.stages[last]
        workdir = workdir or (final.workdir if final.workdir != "/" else "/app")
        unsupported = None
        try:
            self._stage(last)
            python, debian = also
            where = "the tests' and solution's scripts"
            if debian:
                self._record(where, " ".join(["apt-get install"] + debian),
                             packages.debian_packages(debian, self.layers[last]))
            if python:
                self._record(where, " ".join(["pip install"] + python),
                             packages.python_packages(python, self.layers[last]), python)
        except _Unsupported as err:
            unsupported = str(err)
        finally:
            for root in self.roots.values():
                root.close()
        layer = os.path.join(self.staging, "layer")
        if last in self.layers:
            os.rename(self.layers[last], layer)
        else:
            os.makedirs(layer, mode=0o755)
        tree.rmtree(self.work)
        for part, path in (("app", workdir), ("tmp", "/tmp")):  # the sandbox's own directories, filled per episode
            inside = layer + path
            if os.path.isdir(inside) and not os.path.islink(inside):
                os.rename(inside, os.path.join(self.staging, part))
            else:
                os.makedirs(os.path.join(self.staging, part))
        _prune(layer)
        if final.user and final.user not in ("root", "0", "0:0"):
            self.notes.append(f"USER {final.user}: agent commands run as the sandbox's own uid, under that name; the "
                              "verifier's as root of its own user namespace")
        return Image(None, workdir, dict(final.env), final.user, tuple(dict.fromkeys(self.notes)),
                     tuple(self.installs), unsupported)

    # ----- stages --------------------------------------------------------------------------
    def _stage(self, index: int) -> None:
        stage = self.stages[index]
        layer = os.path.join(self.work, f"stage-{index}")
        if stage.base.startswith("stage:"):
            earlier = int(stage.base.split(":")[1])
            if earlier not in self.layers:
                self._stage(earlier)
            # cp -a keeps what a layer holds besides files: whiteouts, opaque directories' xattrs, owners
            subprocess.run(["cp", "-a", "--", self.layers[earlier], layer], check=True, capture_output=True)
        else:
            os.makedirs(layer, mode=0o755)
            self._base(stage, layer)
        os.chmod(layer, 0o755)
        self.layers[index] = layer
        for step in stage.steps:
            handler = getattr(self, f"_{step.op.lower()}", None)
            if handler is not None:
                handler(index, step)
            elif step.op == "ENTRYPOINT" and index == len(self.stages) - 1 and not _PLAIN_ENTRY.issuperset(
                    posixpath.basename(w) for w in step.words):
                raise _Unsupported(f"{step.where}: ENTRYPOINT {' '.join(step.words)}: the image's container starts it "
                                   "before any command, and a sandbox starts nothing (no process outlives a command)")
            elif step.op in _NOTED:
                self.notes.append(f"{step.where}: {step.op} {' '.join(step.words)}: not applied "
                                  "(nothing is started in a sandbox)")

    def _root(self, index: int) -> BuildRoot:
        if index not in self.roots:
            scratch = os.path.join(self.work, f"scratch-{index}")
            os.makedirs(os.path.join(scratch, "in"), exist_ok=True)
            os.makedirs(os.path.join(scratch, "out"), exist_ok=True)
            try:
                self.roots[index] = BuildRoot(self.layers[index], os.path.join(scratch, "root"),
                                              extra=((os.path.join(scratch, "in"), _IN, False),
                                                     (os.path.join(scratch, "out"), _OUT, True)))
            except SandboxError as err:
                raise _Unsupported(f"{self.stages[index].where}: the build sandbox cannot run here: {err}") from None
        return self.roots[index]

    def _base(self, stage: dockerfile.Stage, layer: str) -> None:
        report = packages.base_image(stage.base, layer)
        self.notes += report.notes
        if report.missing:
            raise _Unsupported(f"{stage.where}: FROM {stage.base}: the base image provides "
                               f"{', '.join(report.missing)}, which cannot be installed here")

    def _exec(self, index: int, step: dockerfile.Instruction, script: str, *, stdin: str | None = None) -> str:
        """Run ``script`` for ``step`` in stage ``index``'s build sandbox; its output, or
        ``_Unsupported`` naming the step when it fails."""
        env = {"HOME": "/root", **{k: v for k, v in step.env.items() if v is not None}}
        env["PATH"] = f"{TOOLS}/bin:" + re.sub(r"\$\{PATH\}|\$PATH\b", _DOCKER_PATH, env.get("PATH", _DOCKER_PATH))
        uid = self._uid(index, step)
        result = self._root(index).run(script, env=env, cwd=step.cwd, uid=uid, shell=step.shell, stdin=stdin)
        if not result.ok:
            raise _Unsupported(f"{step.where}: {step.op} {_short(' '.join(step.words))} fails in the build sandbox "
                               f"{result.summary(timing=False)}: ...{result.output[-500:].strip()}")
        return result.output

    def _uid(self, index: int, step: dockerfile.Instruction) -> int | None:
        """The uid of ``step.user`` (a name from the image's passwd file, or a number)."""
        name = step.user.split(":")[0]
        if name in ("", "root", "0"):
            return None
        if name.isdigit():
            return int(name)
        for passwd in (self.layers[index] + "/etc/passwd", "/etc/passwd"):
            if os.path.isfile(passwd) and not os.path.islink(passwd):
                with open(passwd, errors="replace") as f:
                    for line in f:
                        fields = line.split(":")
                        if fields[0] == name and len(fields) > 2 and fields[2].isdigit():
                            return int(fields[2])
        raise _Unsupported(f"{step.where}: USER {step.user}: no such user in the image")

    # ----- instructions ------------------------------------------------------------------
    def _workdir(self, index: int, step: dockerfile.Instruction) -> None:
        self._exec(index, dataclasses.replace(step, user="", cwd="/"), f"mkdir -p {shlex.quote(step.words[0])}")

    def _user(self, index: int, step: dockerfile.Instruction) -> None:
        self._uid(index, dataclasses.replace(step, user=step.words[0]))

    def _run(self, index: int, step: dockerfile.Instruction) -> None:
        if "mount" in step.flags:
            self.notes.append(f"{step.where}: RUN --mount={step.flags['mount']}: nothing is mounted")
        script = self._install(index, step)
        if not script.strip():
            return
        if script.startswith("#!") and step.heredocs and script == step.heredocs[0][1]:
            interpreter = script.splitlines()[0][2:].strip()
            self._exec(index, step, f"exec {interpreter} /dev/stdin", stdin=script)
        else:
            self._exec(index, step, script)

    def _install(self, index: int, step: dockerfile.Instruction) -> str:
        """``step``'s script with its install steps taken out, done here through the
        registries (``envs/image/packages.py``) into the stage's layer."""
        layer = self.layers[index]
        try:
            found = shell_syntax.commands(step.script)
        except ValueError as err:
            raise _Unsupported(f"{step.where}: RUN is not shell syntax: {err}") from None
        spans = []
        for command in found:
            words = _unwrap(command.words)
            name, args = (posixpath.basename(words[0]), words[1:]) if words else ("", [])
            if name in ("apt-get", "apt", "aptitude", "apk", "yum", "dnf", "microdnf"):  # as Debian's packages
                names = host_tools.apt_packages(args)
                if names:
                    self._record(step.where, step.script[command.start:command.end],
                                 packages.debian_packages([n for n in names if "$" not in n], layer))
                spans.append((command.start, command.end, "true"))
            elif name in ("pip", "pip3") or (name == "uv" and args[:2] == ["pip", "install"]):
                args = args[1:] if name == "uv" else args
                if args[:1] != ["install"]:
                    continue
                reqs, sources = host_tools.pip_requirements(args[1:], lambda p: self._read(index, step, p))
                if sources:
                    raise _Unsupported(f"{step.where}: `{_short(step.script[command.start:command.end])}`: "
                                       f"installs {sources[0]}, which only pip inside the image could build")
                self._record(step.where, step.script[command.start:command.end],
                             packages.python_packages(reqs, layer), reqs)
                spans.append((command.start, command.end, "true"))
        return shell_syntax.rewrite(step.script, spans)

    def _record(self, where: str, text: str, report, requirements=()) -> None:
        text = _short(text)
        self.installs.append({"where": where, "command": text, "installed": list(report.installed),
                              "notes": list(report.notes), "missing": list(report.missing),
                              "packages": list(requirements)})
        if report.missing:
            more = f" and {len(report.missing) - 3} more" if len(report.missing) > 3 else ""
            raise _Unsupported(f"{where}: `{text}`: {', '.join(report.missing[:3])}{more} cannot be installed "
                               "here" + (f" ({'; '.join(report.notes[-2:])})" if report.notes else ""))

    def _read(self, index: int, step: dockerfile.Instruction, path: str) -> str | None:
        """A text file of the image (``pip install -r`` reads one), by its path in the image."""
        inside = posixpath.normpath(posixpath.join(step.cwd, path))
        host = os.path.realpath(self.layers[index] + inside)
        if not host.startswith(os.path.realpath(self.layers[index]) + os.sep) or not os.path.isfile(host):
            return None
        with open(host, encoding="utf-8", errors="replace") as f:
            return f.read()

    def _copy(self, index: int, step: dockerfile.Instruction) -> None:
        """COPY and ADD: the sources staged read-only at ``_IN``, copied inside the build
        sandbox with Docker's rules, so that the image's own links are followed there."""
        root = self._root(index)
        staged = os.path.join(os.path.dirname(root.scratch), "in")
        tree.rmtree(staged)
        os.makedirs(staged)
        words, dest = list(step.words[:-1]), step.words[-1]
        target = posixpath.normpath(posixpath.join(step.cwd, dest))
        sources = self._sources(index, step, words, staged)
        into = dest.endswith("/") or len(sources) > 1
        lines = ["set -e", f"dest={shlex.quote(target)}", "set --"]  # "$@": what was copied, for --chown/--chmod
        if into or any(kind != "file" for kind, _ in sources):
            lines.append('mkdir -p "$dest"')
        else:
            lines.append('mkdir -p "$(dirname "$dest")"')
        for kind, name in sources:
            src, base = shlex.quote(f"{_IN}/{name}"), shlex.quote(posixpath.basename(name))
            if kind == "dir":
                tops = sorted(os.listdir(os.path.join(staged, name)))
                lines += [f"cp -a {src}/. \"$dest\"/"] + [f'set -- "$@" "$dest"/{shlex.quote(t)}' for t in tops]
            elif kind == "archive":
                lines.append(f'tar -xf {src} -C "$dest"')
            elif into:
                lines += [f'cp -a {src} "$dest"/', f'set -- "$@" "$dest"/{base}']
            else:  # one file: into a directory that is there, else to the path itself
                lines += [f'item="$dest"; if [ -d "$dest" ]; then item="$dest"/{base}; fi',
                          f'cp -a {src} "$item"', 'set -- "$@" "$item"']
        for flag, tool in (("chown", "chown"), ("chmod", "chmod")):
            if step.flags.get(flag):
                lines.append(f'if [ $# -gt 0 ]; then {tool} -R {shlex.quote(step.flags[flag])} "$@"; fi')
        self._exec(index, step, "\n".join(lines))

    _add = _copy

    def _sources(self, index: int, step: dockerfile.Instruction, words: list[str],
                 staged: str) -> list[tuple[str, str]]:
        """Stage each source of a COPY/ADD in ``staged``: [(kind, name)], kind "file",
        "dir" (its contents are copied) or "archive" (ADD unpacks it)."""
        out = []
        if step.heredocs:  # COPY <<EOF /path: each here-document is a file named after it
            for n, (name, body) in enumerate(step.heredocs):
                os.makedirs(os.path.join(staged, str(n)))
                with open(os.path.join(staged, str(n), name), "w") as f:
                    f.write(body)
                out.append(("file", f"{n}/{name}"))
            return out
        source_stage = step.flags.get("from")
        if source_stage is not None:
            return self._from_stage(index, step, source_stage, words, staged)
        for word in words:
            if "://" in word:
                raise _Unsupported(f"{step.where}: {step.op} {word}: fetching a URL needs the network")
            matches = self._match(word)
            if not matches:
                raise BuildError(f"{step.where}: {step.op} source {word!r} is not in the build context "
                                 f"{self.source.context}" + (" (or .dockerignore leaves it out)"
                                                             if self.source.ignore else ""))
            for rel in matches:
                n = str(len(out))
                full = os.path.join(self.source.context, rel) if rel else self.source.context
                os.makedirs(os.path.join(staged, n))
                if os.path.isdir(full) and not os.path.islink(full):
                    self._stage_dir(full, rel, os.path.join(staged, n, "d"))
                    out.append(("dir", f"{n}/d"))
                else:
                    shutil.copy2(full, os.path.join(staged, n, os.path.basename(full)), follow_symlinks=False)
                    archive = step.op == "ADD" and not os.path.islink(full) and tarfile.is_tarfile(full)
                    out.append(("archive" if archive else "file", f"{n}/{os.path.basename(full)}"))
        return out

    def _match(self, word: str) -> list[str]:
        """The context paths a COPY source names (globs expanded), never outside it."""
        rel = posixpath.normpath(word.lstrip("/"))
        if rel == "..":
            return []
        if rel.startswith("../"):
            raise _Unsupported(f"COPY source {word!r} is outside the build context")
        if rel == ".":
            return [""]
        if glob.has_magic(rel):
            return sorted(p.rstrip("/") for p in self.visible
                          if re.fullmatch(_glob_regex(rel), p.rstrip("/")))
        return [rel] if (rel in self.visible or rel + "/" in self.visible) else []

    def _stage_dir(self, full: str, rel: str, into: str) -> None:
        """A directory of the context with what ``.dockerignore`` leaves out taken away."""
        os.makedirs(into)
        prefix = rel + "/" if rel else ""
        for entry in tree.walk(full):
            path = prefix + entry.path
            if contexts.ignored(path, self.source.ignore):
                continue
            dst = os.path.join(into, entry.path)
            if entry.is_dir:
                os.makedirs(dst, exist_ok=True)
            else:
                shutil.copy2(os.path.join(full, entry.path), dst, follow_symlinks=False)

    def _from_stage(self, index: int, step, name: str, words: list[str], staged: str) -> list[tuple[str, str]]:
        if _UV_IMAGE.search(name):
            self.notes.append(f"{step.where}: {step.op} --from={name}: uv and uvx are the sandbox's own")
            return []
        earlier = int(name) if name.isdigit() else next(
            (k for k, s in enumerate(self.stages) if s.name == name.lower()), None)
        if earlier is None or earlier >= index:
            raise _Unsupported(f"{step.where}: {step.op} --from={name}: copying from another image needs Docker")
        if earlier not in self.layers:
            self._stage(earlier)
        out = os.path.join(os.path.dirname(self._root(earlier).scratch), "out")
        tree.rmtree(out)
        os.makedirs(out)
        copy = "\n".join(["set -e"] + [f"mkdir -p {_OUT}/{n} && cp -a {shlex.quote(w)} {_OUT}/{n}/"
                                      for n, w in enumerate(words)])
        self._exec(earlier, dataclasses.replace(step, cwd=self.stages[earlier].workdir, user=""), copy)
        found = []
        for n, word in enumerate(words):
            item = os.path.join(out, str(n), posixpath.basename(word.rstrip("/")) or ".")
            shutil.move(os.path.join(out, str(n)), os.path.join(staged, str(n)))
            kind = "dir" if os.path.isdir(item) and not os.path.islink(item) else "file"
            found.append((kind, f"{n}/{os.path.basename(item)}"))
        return found


def _prune(layer: str) -> None:
    """Remove the empty directories of ``layer`` (mount points and upper directories the
    build sandbox made), except opaque ones, which hide what is below them."""
    for entry in tree.walk(layer, bottom_up=True):
        if entry.is_dir and not os.listdir(os.path.join(layer, entry.path)):
            try:
                os.getxattr(os.path.join(layer, entry.path), "trusted.overlay.opaque")
            except OSError:
                os.rmdir(entry.name, dir_fd=entry.dir_fd)


def _unwrap(words: list[str]) -> list[str]:
    """The command under ``sudo``, ``env A=b``, ``timeout 60``; ``python -m pip`` is pip."""
    while words and words[0] in _WRAPPERS:
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0] or re.fullmatch(r"\d+[smh]?", words[0])):
            words = words[1:]
    if len(words) >= 3 and re.fullmatch(r"python(3(\.\d+)?)?", posixpath.basename(words[0])) and words[1:3] == [
            "-m", "pip"]:
        words = ["pip"] + words[3:]
    return words


def _glob_regex(pattern: str) -> str:
    """Go's filepath.Match, as COPY's globs are: ``*`` and ``?`` stop at ``/``."""
    out = []
    for part in re.split(r"(\*|\?|\[[^]]*\])", pattern):
        out.append("[^/]*" if part == "*" else "[^/]" if part == "?" else part if part.startswith("[")
                   else re.escape(part))
    return "".join(out)


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
