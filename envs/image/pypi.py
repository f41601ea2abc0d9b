"""Python packages from PyPI, fetched at image-build time into a task's layer.

``python_packages(requirements, layer)``: pip resolves the requirements for the sandbox's
interpreter (this one, ``sys.executable``, never another environment) against what it
already has, the layer's packages (an earlier step's) first; what pip would install (a
pinned version the host has at another version too) is copied into ``layer/SITE``, where
the sandbox's python finds it before its own site-packages (the guard of
``envs/image/host_tools.py`` puts it there), and each console script into
``layer/usr/local/bin``. A pin the index lacks falls back to the newest release, noted.

Cache (``envs/image/fetched.py``): ``wheels/``, from which a call whose packages are all
there resolves and installs without the network; ``installed/pyXY/NAME-VERSION/``, each
distribution installed by itself once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile

from envs.image import fetched, host_tools

SITE = host_tools.SITE
BIN = "/usr/local/bin"
_PROVIDED = {"pip", "setuptools", "wheel", "uv"}  # the sandbox's own tools


def _pip(args: list[str], layer: str | None) -> subprocess.CompletedProcess:
    """pip of the sandbox's interpreter, seeing the layer's packages as installed, before the host's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    if layer and os.path.isdir(layer + SITE):
        env["PYTHONPATH"] = layer + SITE
    return subprocess.run([sys.executable, "-m", "pip", *args], env=env, capture_output=True, text=True)


def _resolve(requirements: list[str], layer: str, wheels: str) -> tuple[list[tuple[str, str]] | None, str]:
    """[(name, version)] pip would install for ``requirements``, or (None, pip's error):
    from the wheel cache alone when it has everything, else from the index."""
    error = ""
    for offline in (True, False):
        with tempfile.TemporaryDirectory(prefix="glmjax-pip-") as tmp:
            args = ["install", "--dry-run", "--quiet", "--report", f"{tmp}/report.json"]
            args += ["--no-index", "--find-links", wheels] if offline else []
            result = _pip(args + requirements, layer)
            if result.returncode == 0:
                with open(f"{tmp}/report.json") as f:
                    items = json.load(f)["install"]
                return [(i["metadata"]["name"], i["metadata"]["version"]) for i in items], ""
            error = fetched.last_error(result.stderr)
    return None, error


def _name(requirement: str) -> str | None:
    found = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return found.group(1) if found else None


def _pin(requirement: str) -> str | None:
    found = re.search(r"==\s*([^,;\s]+)\s*$", requirement)
    return found.group(1) if found else None


def _plan(requirements: list[str], layer: str, wheels: str, report: fetched.Report) -> list[tuple[str, str]]:
    found, _ = _resolve(requirements, layer, wheels)
    if found is not None:
        return found
    plan = {}
    for requirement in requirements:  # one at a time: which one fails, and a pin's fallback
        found, error = _resolve([requirement], layer, wheels)
        if found is None and _pin(requirement):
            found, _ = _resolve([_name(requirement)], layer, wheels)
            if found is not None:
                report.notes.append(f"{requirement}: that version cannot be had ({error}); the newest release "
                                    "instead")
        if found is None:
            report.missing.append(f"python package {requirement}: {error}")
        plan.update({host_tools.normal_name(n): (n, v) for n, v in found or ()})
    return list(plan.values())


def _cached(wheels: str, name: str, version: str) -> bool:
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    return any(f.lower().startswith(stem) and f.endswith(".whl") for f in os.listdir(wheels))


_SCRIPT = '''#!{python}
# {name}: a console script of {dist} (envs/image/pypi.py); the layer's packages come before the interpreter's
import sys
sys.path.insert(next((i for i, p in enumerate(sys.path) if p.endswith("-packages")), len(sys.path)), {site!r})
from {module} import {head}
sys.exit({attr}())
'''


def _installed_alone(wheels: str, plan: list[tuple[str, str]]) -> list[str]:
    """Each ``name==version`` of ``plan`` installed by itself (``--no-deps --target``) from
    the wheel cache, once per machine and interpreter version: one pip run installs those
    not yet there, and their files are parted by each distribution's RECORD."""
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    installed = os.path.join(os.path.dirname(wheels), "installed", python)
    trees = [os.path.join(installed, f"{host_tools.normal_name(n)}-{v}") for n, v in plan]
    todo = [(n, v) for (n, v), tree in zip(plan, trees) if not os.path.isdir(tree)]
    if not todo:
        return trees
    with tempfile.TemporaryDirectory(prefix="glmjax-pip-", dir=os.path.dirname(wheels)) as staging:
        result = _pip(["install", "--quiet", "--no-deps", "--no-index", "--find-links", wheels, "--target", staging,
                       *(f"{n}=={v}" for n, v in todo)], layer=None)
        if result.returncode != 0:
            asked = " ".join(f"{n}=={v}" for n, v in todo)
            raise _Failed(f"python packages {asked}: {fetched.last_error(result.stderr)}")
        for dist in importlib.metadata.distributions(path=[staging]):
            tree = os.path.join(installed, f"{host_tools.normal_name(dist.metadata['Name'])}-{dist.version}")
            fetched.once(tree, functools.partial(_move_files, dist, staging))
    lost = [f"{n}=={v}" for (n, v), tree in zip(plan, trees) if not os.path.isdir(tree)]
    if lost:
        raise _Failed(f"python packages {' '.join(lost)}: pip installed no distribution of that name and version")
    return trees


def _move_files(dist: importlib.metadata.Distribution, staging: str, tree: str) -> None:
    """Move the files of ``dist`` (its RECORD) from ``staging`` into ``tree``; pip's console
    scripts (``bin/``) are left out (see ``_console_scripts``)."""
    for file in dist.files or ():
        source = os.path.normpath(os.path.join(staging, file))
        if source.startswith(staging + os.sep) and not source.startswith(staging + "/bin/") and os.path.lexists(source):
            os.makedirs(os.path.dirname(os.path.join(tree, file)), exist_ok=True)
            os.rename(source, os.path.normpath(os.path.join(tree, file)))


class _Failed(Exception):
    """A package that was resolved but cannot be installed (its message names it)."""


def _remove(site: str, name: str) -> None:
    """Take an earlier step's version of ``name`` out of ``site`` before another goes in."""
    for dist in importlib.metadata.distributions(name=name, path=[site]):
        dirs = set()
        for file in dist.files or ():  # its RECORD, which lists the .dist-info directory's files too
            path = os.path.normpath(os.path.join(site, file))
            if path.startswith(site + os.sep) and (os.path.isfile(path) or os.path.islink(path)):
                os.unlink(path)
                dirs.add(os.path.dirname(path))
        for directory in sorted(dirs, key=len, reverse=True):
            while directory.startswith(site + os.sep) and os.path.isdir(directory) and not os.listdir(directory):
                os.rmdir(directory)  # a directory left empty (one another distribution shares is not)
                directory = os.path.dirname(directory)


def _console_scripts(layer: str, names: set[str]) -> None:
    """Console scripts of the distributions ``names`` in ``layer/BIN``, run by the sandbox's
    interpreter with the layer's packages on its path (pip's own, with a plain shebang, are
    left out)."""
    os.makedirs(layer + BIN, exist_ok=True)
    for dist in importlib.metadata.distributions(path=[layer + SITE]):
        if host_tools.normal_name(dist.metadata["Name"]) not in names:
            continue
        for point in dist.entry_points:
            if point.group not in ("console_scripts", "gui_scripts"):
                continue
            module, _, attr = point.value.partition(":")
            attr = attr.strip() or "main"
            path = os.path.join(layer + BIN, point.name)
            with open(path, "w") as f:
                f.write(_SCRIPT.format(python=sys.executable, name=point.name, dist=dist.metadata["Name"],
                                       site=SITE, module=module.strip(), head=attr.split(".")[0], attr=attr))
            os.chmod(path, 0o755)


def python_packages(requirements: list[str], layer: str) -> fetched.Report:
    """Fetch what the sandbox's interpreter lacks of ``requirements`` into ``layer`` (see the
    module docstring)."""
    report, asked = fetched.Report(), []
    for requirement in requirements:
        name = _name(requirement)
        if name is None:
            report.missing.append(f"python package {requirement!r}: not a requirement pip can read")
        elif host_tools.normal_name(name) in _PROVIDED:
            report.notes.append(f"{name}: the sandbox's own")
        else:
            asked.append(requirement)
    if not asked:
        return report
    with fetched.locked(os.path.join(fetched.cache_dir(), "wheels")) as wheels:
        plan = _plan(asked, layer, wheels, report)
        fetch = [f"{n}=={v}" for n, v in plan if not _cached(wheels, n, v)]
        if fetch:
            result = _pip(["wheel", "--quiet", "--no-deps", "--wheel-dir", wheels, *fetch], layer)
            if result.returncode != 0:
                report.missing.append(f"python packages {' '.join(fetch)}: {fetched.last_error(result.stderr)}")
                return report
        try:
            trees = _installed_alone(wheels, plan)
        except _Failed as err:
            report.missing.append(str(err))
            return report
        for (name, _), tree in zip(plan, trees):
            _remove(layer + SITE, name)
            fetched.lay(tree, layer + SITE)
        _console_scripts(layer, {host_tools.normal_name(n) for n, _ in plan})
    report.installed += [f"{n} {v}" for n, v in plan]
    got = {host_tools.normal_name(n): v for n, v in plan}
    failed = " ".join(report.missing)
    for requirement in asked:
        name, pin = _name(requirement), _pin(requirement)
        version = got.get(host_tools.normal_name(name))
        if version is None and f" {requirement}:" not in failed:  # pip found it satisfied
            report.notes.append(_present(requirement, layer))
        elif version is not None and pin and pin != version:
            report.notes.append(f"{name}: {version} installed ({pin} asked)")
    return report


def _present(requirement: str, layer: str) -> str:
    """Where a satisfied requirement is: the layer (an earlier step's) or the host."""
    for dist in importlib.metadata.distributions(name=_name(requirement), path=[layer + SITE]):
        return f"{dist.metadata['Name']} {dist.version} already in the layer"
    return host_tools.python_package(requirement)[1]
