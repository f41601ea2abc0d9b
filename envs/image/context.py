"""Where a task's image is built from: its Dockerfile and build context, as the task's
compose file or layout puts them, and the files of the context a build sees.

    layout           default context, Dockerfile     compose file that moves them
    Harbor           environment/, its Dockerfile    environment/docker-compose.yaml: it is
                                                     merged over Harbor's own, whose service
                                                     ``main`` is the task's container:
                                                     ``services.main.build.context`` is
                                                     relative to environment/, ``dockerfile``
                                                     to the context
    Terminal-Bench   the task, its Dockerfile        docker-compose.yaml: its one service's
                                                     ``build`` (``context``, ``dockerfile``)

Another service beside the task's container is a second container, and a service with an
``image`` and no ``build`` (or ``[environment] docker_image`` without a Dockerfile) a
prebuilt image: both need Docker, and the source says so (``unsupported``). A context may
lie outside ``environment/`` (``context: ..``): it is where the compose file puts it, but
never outside the task's directory. The files a build sees skip what ``.dockerignore``
(the context's, or ``<Dockerfile>.dockerignore`` beside the Dockerfile, as BuildKit reads
them) leaves out.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import os
import re

import yaml

from envs.sandbox import tree


@dataclasses.dataclass(frozen=True)
class Source:
    """``dockerfile`` (None: the task has none, and the host stands in for its image as it
    is), ``context``, ``where`` (the Dockerfile's path in the task, for messages) and the
    ``.dockerignore`` patterns; ``unsupported``: why the image needs Docker."""

    context: str
    dockerfile: str | None
    where: str
    ignore: tuple[str, ...] = ()
    unsupported: str | None = None


def _compose(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("services", {}), dict):
        raise ValueError(f"{path}: services must be a mapping of service names to services")
    return data.get("services") or {}


def _build(service, where: str) -> tuple[str | None, str | None]:
    """(context, dockerfile) of a compose service's ``build`` (either may be None)."""
    build = service.get("build") if isinstance(service, dict) else None
    if build is None:
        return None, None
    if isinstance(build, str):
        return build, None
    if not isinstance(build, dict):
        raise ValueError(f"{where}: build must be a path or a mapping, got {build!r}")
    return build.get("context"), build.get("dockerfile")


def locate(task: str, layout: str, docker_image: str | None = None) -> Source:
    """The image source of the task at ``task`` (``layout``: "harbor" or "terminal-bench")."""
    task = os.path.realpath(task)
    if layout == "harbor":
        base = os.path.join(task, "environment")
        compose = next((os.path.join(base, n) for n in ("docker-compose.yaml", "docker-compose.yml")
                        if os.path.isfile(os.path.join(base, n))), None)
        main, others = "main", []
        services = _compose(compose) if compose else {}
        others = [name for name in services if name != main]
        context, file = _build(services.get(main), os.path.relpath(compose or base, task))
    else:
        base = task
        compose = next((os.path.join(base, n) for n in ("docker-compose.yaml", "docker-compose.yml")
                        if os.path.isfile(os.path.join(base, n))), None)
        services = _compose(compose) if compose else {}
        main = next(iter(services), None)
        others = list(services)[1:]
        context, file = _build(services.get(main), os.path.relpath(compose or base, task))
        if main is not None and context is None and isinstance(services[main], dict) and services[main].get("image"):
            docker_image = str(services[main]["image"])
    context = os.path.realpath(os.path.join(base, context or "."))
    dockerfile = os.path.realpath(os.path.join(context, file or "Dockerfile"))
    where = os.path.relpath(dockerfile, task)
    unsupported = None
    if others:
        unsupported = (f"{os.path.relpath(compose, task)}: service {others[0]!r} is a second container beside the "
                       f"task's; several containers need Docker")
    elif context != task and not context.startswith(task + os.sep):
        unsupported = f"{os.path.relpath(compose, task)}: the build context {context} is outside the task's directory"
    elif not os.path.isfile(dockerfile):
        if docker_image:
            unsupported = f"the prebuilt image {docker_image!r} needs Docker"
        elif file or compose and context != base:
            unsupported = f"{os.path.relpath(compose, task)}: its Dockerfile {where} does not exist"
        return Source(context, None, where, unsupported=unsupported)
    return Source(context, dockerfile, where, _ignore_patterns(context, dockerfile), unsupported)


def _ignore_patterns(context: str, dockerfile: str) -> tuple[str, ...]:
    for path in (dockerfile + ".dockerignore", os.path.join(context, ".dockerignore")):
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f]
            return tuple(line for line in lines if line and not line.startswith("#"))
    return ()


def _pattern(text: str) -> re.Pattern:
    """A ``.dockerignore`` pattern (Go's filepath.Match, ``**`` for any directories) as a
    regular expression over a path and, so that a directory takes its contents, its parents."""
    text = os.path.normpath(text.lstrip("/")).replace(os.sep, "/")
    parts = [".*" if part == "**" else fnmatch.translate(part)[4:-3] for part in text.split("/")]
    body = "/".join(parts).replace(".*/", "(?:.*/)?")
    return re.compile(f"(?s:{body})(?:/.*)?")


def ignored(rel: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``.dockerignore`` ``patterns`` leave the context's path ``rel`` out (the last
    pattern that matches decides; ``!`` keeps)."""
    verdict = False
    for text in patterns:
        keep = text.startswith("!")
        if _pattern(text[1:] if keep else text).fullmatch(rel):
            verdict = not keep
    return verdict


def digest(source: Source) -> str:
    """A hash of what a build of ``source`` reads: the Dockerfile, and every file of the
    context it sees (path, mode, contents; a link by its target)."""
    h = hashlib.sha256()
    if source.dockerfile:
        with open(source.dockerfile, "rb") as f:
            h.update(b"dockerfile\0" + f.read())
    if os.path.isdir(source.context):
        for entry in tree.walk(source.context):
            if ignored(entry.path, source.ignore):
                continue
            h.update(f"{entry.path}\0{entry.stat.st_mode:o}\0".encode())
            if os.path.islink(os.path.join(source.context, entry.path)):
                h.update(os.readlink(entry.name, dir_fd=entry.dir_fd).encode())
            elif not entry.is_dir:
                h.update(hashlib.sha256(entry.read()).digest())
    return h.hexdigest()
