"""Packages from the registries, fetched at image-build time into a task's layer.

A task's image installs what it needs (``pip install PyJWT==2.8.0``, ``apt-get install jq``,
``FROM golang:1.22``). The sandbox has no network, so what the host lacks is fetched here,
outside it, through the registries this machine reaches (PyPI, Debian's archive), into the
task's *layer*: a directory of the image's files at their absolute paths
(``layer/usr/bin/jq``), laid over the host's root in the sandbox. Nothing here changes the
host's own python environment or its apt and dpkg state.

- ``python_packages(requirements, layer)``: pip resolves the requirements for the sandbox's
  interpreter (this one, ``sys.executable``) against what it already has, the layer's
  packages first; what pip would install (a pinned version the host has at another version
  too) goes with ``--target`` into ``layer/SITE``, its console scripts into
  ``layer/usr/local/bin``. A pin the index lacks falls back to the newest release, noted.
- ``debian_packages(names, layer)``: apt, with a configuration, package lists and archive
  cache of its own (the host's sources and keys), resolves the names against the host's
  dpkg status; each package the host lacks (or has older than a dependency needs) is
  unpacked into the layer with ``dpkg-deb -x`` and listed in ``layer/DEBIAN_STATUS`` for
  the sandbox's ``apt-get``. Maintainer scripts do not run (noted). ``python3-X`` is
  PyPI's X for the sandbox's interpreter: Debian's lands in /usr/lib/python3/dist-packages,
  which that interpreter does not read.
- ``base_image(ref, layer)``: an official image's toolchain as Debian packages
  (``golang:1.22`` -> golang-go), nothing where the sandbox's PATH has the tool already.

Every deviation from what was asked is a note of the ``Report``; what cannot be had is in
``Report.missing``, naming the package and why. Downloads are cached across tasks under
``$GLMJAX_CACHE/packages`` (default ``~/.cache/glmjax/packages``): wheels in ``wheels/``
(a call whose packages are all there resolves and installs offline), apt's lists (fetched
again after a day) and archives in ``apt/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from envs.image import host_tools, shell_syntax

SITE = host_tools.SITE
BIN = "/usr/local/bin"
DEBIAN_STATUS = host_tools.DEBIAN_STATUS
_LISTS_MAX_AGE_S = 24 * 3600
_PROVIDED = {"pip", "setuptools", "wheel", "uv"}  # the sandbox's own tools
# another distribution's name (Ubuntu's mostly) -> Debian's nearest package, tried when Debian has no such name
_SUBSTITUTES = {"chromium-browser": "chromium", "chromium-chromedriver": "chromium-driver",
                "mysql-server": "default-mysql-server", "mysql-client": "default-mysql-client",
                "linux-tools-common": "linux-perf", "linux-tools-generic": "linux-perf", "libv8-dev": "libnode-dev"}
_OTHER_JDK = re.compile(r"openjdk-\d+-(jdk|jre)(-headless)?")  # bookworm's is 17
_INST = re.compile(r"^Inst (\S+) (?:\[(\S+)\] )?\((\S+) .*\[(\S+)\]\)", re.M)


@dataclasses.dataclass
class Report:
    """What one call did: ``installed`` ("name version" put into the layer), ``notes`` (every
    deviation from what was asked), ``missing`` (what could not be had, each naming the
    package and why)."""

    installed: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Report) -> Report:
        self.installed += other.installed
        self.notes += other.notes
        self.missing += other.missing
        return self


def cache_dir() -> str:
    root = os.environ.get("GLMJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "glmjax")
    return os.path.join(root, "packages")


@contextlib.contextmanager
def _locked(directory: str):
    """One process at a time fetches into a cache directory (builds run in parallel)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield directory


def _once(path: str, make) -> str:
    """``path``, made by ``make(staging)`` the first time (an unpacked package, kept for every
    later layer: copying it is much cheaper than unpacking it again)."""
    if not os.path.isdir(path):
        staging = path + ".partial"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        make(staging)
        os.rename(staging, path)
    return path


def _lay(tree: str, layer: str) -> None:
    """Copy ``tree`` over ``layer`` (the directories they share merged)."""
    os.makedirs(layer, exist_ok=True)
    subprocess.run(["cp", "-a", "--reflink=auto", f"{tree}/.", f"{layer}/"], check=True, capture_output=True)


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("ERROR:", "E:"))]
    return (errors or lines or ["no output"])[0 if errors else -1].removeprefix("ERROR: ").removeprefix("E: ")


# ----- python ------------------------------------------------------------------------------------
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
            error = _last_error(result.stderr)
    return None, error


def _name(requirement: str) -> str | None:
    found = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return found.group(1) if found else None


def _pin(requirement: str) -> str | None:
    found = re.search(r"==\s*([^,;\s]+)\s*$", requirement)
    return found.group(1) if found else None


def _plan(requirements: list[str], layer: str, wheels: str, report: Report) -> list[tuple[str, str]]:
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
        plan.update({host_tools._normal(n): (n, v) for n, v in found or ()})
    return list(plan.values())


def _cached(wheels: str, name: str, version: str) -> bool:
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    return any(f.lower().startswith(stem) and f.endswith(".whl") for f in os.listdir(wheels))


_SCRIPT = '''#!{python}
# {name}: a console script of {dist} (envs/image/packages.py); the layer's packages come before the interpreter's
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
    trees = [os.path.join(os.path.dirname(wheels), "installed", python, f"{host_tools._normal(n)}-{v}") for n, v in plan]
    todo = [(n, v) for (n, v), tree in zip(plan, trees) if not os.path.isdir(tree)]
    if not todo:
        return trees
    with tempfile.TemporaryDirectory(prefix="glmjax-pip-", dir=os.path.dirname(wheels)) as staging:
        result = _pip(["install", "--quiet", "--no-deps", "--no-index", "--find-links", wheels, "--target", staging,
                       *(f"{n}=={v}" for n, v in todo)], layer=None)
        if result.returncode != 0:
            raise _Failed(f"python packages {' '.join(f'{n}=={v}' for n, v in todo)}: {_last_error(result.stderr)}")
        for dist in importlib.metadata.distributions(path=[staging]):
            name = host_tools._normal(dist.metadata["Name"])

            def part(tree: str) -> None:
                for file in dist.files or ():  # pip's console scripts (bin/) are left out: see _console_scripts
                    source = os.path.normpath(os.path.join(staging, file))
                    if source.startswith(staging + os.sep) and not source.startswith(staging + "/bin/") \
                            and os.path.lexists(source):
                        os.makedirs(os.path.dirname(os.path.join(tree, file)), exist_ok=True)
                        os.rename(source, os.path.normpath(os.path.join(tree, file)))

            _once(os.path.join(os.path.dirname(wheels), "installed", python, f"{name}-{dist.version}"), part)
    lost = [f"{n}=={v}" for (n, v), tree in zip(plan, trees) if not os.path.isdir(tree)]
    if lost:
        raise _Failed(f"python packages {' '.join(lost)}: pip installed no distribution of that name and version")
    return trees


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
        if host_tools._normal(dist.metadata["Name"]) not in names:
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


def python_packages(requirements: list[str], layer: str) -> Report:
    """Fetch what the sandbox's interpreter lacks of ``requirements`` into ``layer`` (see the
    module docstring)."""
    report, asked = Report(), []
    for requirement in requirements:
        name = _name(requirement)
        if name is None:
            report.missing.append(f"python package {requirement!r}: not a requirement pip can read")
        elif host_tools._normal(name) in _PROVIDED:
            report.notes.append(f"{name}: the sandbox's own")
        else:
            asked.append(requirement)
    if not asked:
        return report
    with _locked(os.path.join(cache_dir(), "wheels")) as wheels:
        plan = _plan(asked, layer, wheels, report)
        fetch = [f"{n}=={v}" for n, v in plan if not _cached(wheels, n, v)]
        if fetch:
            result = _pip(["wheel", "--quiet", "--no-deps", "--wheel-dir", wheels, *fetch], layer)
            if result.returncode != 0:
                report.missing.append(f"python packages {' '.join(fetch)}: {_last_error(result.stderr)}")
                return report
        try:
            trees = _installed_alone(wheels, plan)
        except _Failed as err:
            report.missing.append(str(err))
            return report
        for (name, _), tree in zip(plan, trees):
            _remove(layer + SITE, name)
            _lay(tree, layer + SITE)
        _console_scripts(layer, {host_tools._normal(n) for n, _ in plan})
    report.installed += [f"{n} {v}" for n, v in plan]
    got = {host_tools._normal(n): v for n, v in plan}
    failed = " ".join(report.missing)
    for requirement in asked:
        name, pin = _name(requirement), _pin(requirement)
        version = got.get(host_tools._normal(name))
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


# ----- Debian ------------------------------------------------------------------------------------
def _apt_config(root: str) -> str:
    """apt.conf of the private apt: the host's sources, keys and network settings
    (``Acquire::``), its own lists and archives, none of the host's hooks (``Dir::Etc::Parts``)."""
    dump = subprocess.run(["apt-config", "dump"], capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in dump.splitlines() if ln.startswith("Acquire::") and "::IndexTargets::" not in ln]
    for sub in ("lists/partial", "cache", "archives/partial", "parts"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    lines += [f'Dir::State::Lists "{root}/lists";', f'Dir::Cache "{root}/cache";',
              f'Dir::Cache::Archives "{root}/archives";', f'Dir::Etc::Parts "{root}/parts";',
              f'Dir::State::extended_states "{root}/extended_states";',
              'APT::Sandbox::User "root";', 'Debug::NoLocking "true";', 'APT::Install-Recommends "false";',
              'APT::Get::Assume-Yes "true";', 'Dpkg::Use-Pty "false";']
    path = os.path.join(root, "apt.conf")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _apt_get(root: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, APT_CONFIG=os.path.join(root, "apt.conf"), DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(["apt-get", "-q", *args], env=env, capture_output=True, text=True)


def _apt_lists(root: str) -> str | None:
    """Fetch the package lists when absent or older than a day; an error, or None."""
    _apt_config(root)
    stamp = os.path.join(root, "lists", ".updated")
    if os.path.exists(stamp) and time.time() - os.path.getmtime(stamp) < _LISTS_MAX_AGE_S:
        return None
    result = _apt_get(root, ["update"])
    if result.returncode != 0 or not any("_Packages" in f for f in os.listdir(os.path.join(root, "lists"))):
        return f"apt-get update failed: {_last_error(result.stderr + result.stdout)}"
    open(stamp, "w").close()
    return None


def _simulate(root: str, names: list[str]) -> tuple[list[tuple[str, str, str, str]] | None, str]:
    """[(package, host's version or "", version, architecture)] apt would unpack, or (None, error)."""
    result = _apt_get(root, ["install", "-s", *names])
    if result.returncode != 0:
        return None, _last_error(result.stderr + result.stdout)
    return [(p, old or "", v, a) for p, old, v, a in _INST.findall(result.stdout)], ""


def _debian_plan(root: str, names: list[str], report: Report) -> list[tuple[str, str, str, str]]:
    found, _ = _simulate(root, names)
    if found is not None:
        return found
    plan = {}
    for name in names:  # one at a time: which one fails, and a pinned version's or another name's fallback
        found, error = _simulate(root, [name])
        if found is None and "=" in name:
            found, _ = _simulate(root, [name.split("=")[0]])
            if found is not None:
                report.notes.append(f"{name}: that version is not in the archive ({error}); its candidate instead")
        other = _SUBSTITUTES.get(name) or (_OTHER_JDK.sub(r"openjdk-17-\1\2", name)
                                           if _OTHER_JDK.fullmatch(name) else None)
        if found is None and other:
            found, _ = _simulate(root, [other])
            if found is not None:
                report.notes.append(f"{name}: not in Debian's archive ({error}); Debian's {other} instead")
        if found is None:
            report.missing.append(f"Debian package {name}: {error}")
        plan.update({p[0]: p for p in found or ()})
    return list(plan.values())


def _archive(root: str, package: str, version: str, arch: str) -> str:
    return os.path.join(root, "archives", f"{package}_{version.replace(':', '%3a')}_{arch}.deb")


def _unpacked(root: str, deb: str) -> str:
    """``deb`` unpacked once per machine: ``files/`` (its tree, with ``/bin``, ``/lib``...
    folded into ``/usr`` where the host's are links there, as dpkg would place them) and
    ``control/`` (its control files and maintainer scripts)."""

    def unpack(staging: str) -> None:
        files = os.path.join(staging, "files")
        subprocess.run(["dpkg-deb", "-x", deb, files], check=True, capture_output=True)
        subprocess.run(["dpkg-deb", "-e", deb, os.path.join(staging, "control")], check=True, capture_output=True)
        for top in os.listdir(files):
            if os.path.islink("/" + top) and os.path.isdir(os.path.join(files, top)):
                target = os.path.join(files, os.path.realpath("/" + top).lstrip("/"))
                _lay(os.path.join(files, top), target)
                shutil.rmtree(os.path.join(files, top))

    return _once(os.path.join(root, "unpacked", os.path.basename(deb)[:-len(".deb")]), unpack)


def _alternatives(postinst: str, layer: str) -> list[str]:
    """The ``update-alternatives --install LINK NAME PATH`` links of a postinst (how figlet,
    java or cc get their command names), made as plain links in ``layer`` where neither the
    host nor the layer has LINK; the rest of the script does not run."""
    try:
        commands = shell_syntax.commands(postinst)
    except shell_syntax.ShellSyntaxError:
        return []
    links = []
    for command in commands:
        words = command.words
        if words[:2] != ["update-alternatives", "--install"] or any("$" in w for w in words):
            continue
        pairs = [(words[2], words[4])] if len(words) > 4 else []
        pairs += [(words[i + 1], words[i + 3]) for i, w in enumerate(words) if w == "--slave" and i + 3 < len(words)]
        for link, target in pairs:
            if not os.path.lexists(link) and not os.path.lexists(layer + link) and os.path.lexists(layer + target):
                os.makedirs(os.path.dirname(layer + link), exist_ok=True)
                os.symlink(target, layer + link)
                links.append(link)
    return links


def debian_packages(names: list[str], layer: str) -> Report:
    """Fetch what the host lacks of the Debian packages ``names`` into ``layer`` (see the
    module docstring)."""
    report, wanted, python = Report(), [], []
    present = host_tools.layer_debian(layer + DEBIAN_STATUS)
    for name in dict.fromkeys(names):
        package = name.split("=")[0]
        missing, note = host_tools.apt_package(name, host_tools.SYSTEM_PATH)
        if host_tools.pypi_name(package) and missing:
            python.append(host_tools.pypi_name(package))
            report.notes.append(f"{package}: PyPI's {python[-1]} for the sandbox's python (Debian's package "
                                "installs for Debian's python3)")
        elif missing and package not in present:
            wanted.append(name)
        elif package in present:
            report.notes.append(f"{package} {present[package]} already in the layer")
        else:
            report.notes.append(note)
    if python:
        report.add(python_packages(python, layer))
    if not wanted:
        return report
    with _locked(os.path.join(cache_dir(), "apt")) as root:
        error = _apt_lists(root)
        if error:
            report.missing += [f"Debian package {n}: {error}" for n in wanted]
            return report
        plan = [p for p in _debian_plan(root, wanted, report) if p[0] not in present]
        if any(not os.path.exists(_archive(root, p, v, a)) for p, _, v, a in plan):
            result = _apt_get(root, ["install", "--download-only", *(f"{p}={v}" for p, _, v, _ in plan)])
            if result.returncode != 0:
                report.missing += [f"Debian package {n}: {_last_error(result.stderr + result.stdout)}" for n in wanted]
                return report
        stanzas, scripted = [], []
        for package, old, version, arch in plan:
            unpacked = _unpacked(root, _archive(root, package, version, arch))
            _lay(os.path.join(unpacked, "files"), layer)
            control = host_tools._read_text(os.path.join(unpacked, "control", "control")) or ""
            stanzas.append("Status: install ok installed\n" + control.strip() + "\n")
            report.installed.append(f"{package} {version}")
            if any(os.path.exists(os.path.join(unpacked, "control", n)) for n in ("preinst", "postinst")):
                links = _alternatives(host_tools._read_text(os.path.join(unpacked, "control", "postinst")) or "",
                                      layer)
                scripted.append(package + (f" (its alternatives linked: {', '.join(links)})" if links else ""))
            if old:
                report.notes.append(f"{package}: the host's {old} is {version} in the layer (a dependency needs it)")
    os.makedirs(os.path.dirname(layer + DEBIAN_STATUS), exist_ok=True)
    with open(layer + DEBIAN_STATUS, "a") as f:
        f.write("".join(s + "\n" for s in stanzas))
    if scripted:
        report.notes.append("unpacked without running their maintainer scripts: " + ", ".join(scripted))
    return report


# ----- base images -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StandIn:
    """What stands in for an official image: ``tool`` (the command it provides; None: the
    host itself stands in), how that tool prints its version, and Debian's packages for it."""

    tool: str | None
    version_args: tuple[str, ...] = ("--version",)
    packages: tuple[str, ...] = ()


_HOST = StandIn(None)
_JDK = StandIn("javac", ("-version",), ("default-jdk-headless",))
BASE_IMAGES = {  # an official image's name (the last part of its repository) -> its stand-in
    "debian": _HOST, "ubuntu": _HOST, "buildpack-deps": _HOST, "alpine": _HOST, "busybox": _HOST,
    "python": StandIn("python3"), "pypy": StandIn("python3"),
    "golang": StandIn("go", ("version",), ("golang-go",)),
    "node": StandIn("node", ("--version",), ("nodejs", "npm")),
    "rust": StandIn("cargo", ("--version",), ("cargo", "rustc")),
    "openjdk": _JDK, "eclipse-temurin": _JDK, "amazoncorretto": _JDK, "ibmjava": _JDK, "sapmachine": _JDK,
    "maven": StandIn("mvn", ("--version",), ("maven", "default-jdk-headless")),
    "gradle": StandIn("gradle", ("--version",), ("gradle", "default-jdk-headless")),
    "ruby": StandIn("ruby", ("--version",), ("ruby", "ruby-dev", "bundler")),
    "php": StandIn("php", ("--version",), ("php-cli",)),
    "perl": StandIn("perl", ("-e", "print $^V"), ("perl",)),
    "gcc": StandIn("gcc", ("-dumpfullversion",), ("gcc", "g++", "make")),
    "haskell": StandIn("ghc", ("--numeric-version",), ("ghc", "cabal-install")),
    "r-base": StandIn("R", ("--version",), ("r-base-core",)),
    "r-ver": StandIn("R", ("--version",), ("r-base-core",)),
    "erlang": StandIn("erl", ("-noshell", "-eval", "io:format(erlang:system_info(otp_release)), halt()."),
                      ("erlang-nox",)),
    "elixir": StandIn("elixir", ("--version",), ("elixir",)),
    "postgres": StandIn("psql", ("--version",), ("postgresql",)),
    "redis": StandIn("redis-server", ("--version",), ("redis-server",)),
    "nginx": StandIn("nginx", ("-v",), ("nginx",)),
    "mariadb": StandIn("mariadb", ("--version",), ("mariadb-server",)),
    "mysql": StandIn("mariadb", ("--version",), ("mariadb-server",)),
    "sqlite": StandIn("sqlite3", ("--version",), ("sqlite3",)),
}


def _parse_ref(ref: str) -> tuple[str, str]:
    """(image name, version asked) of ``ref``: ``docker.io/library/golang:1.22-bookworm``
    -> ("golang", "1.22"); ``ghcr.io/x/t-bench/python-3-13:20250620`` -> ("python", "3.13")."""
    ref = ref.split("@")[0]
    repository, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "")
    name = repository.rsplit("/", 1)[-1].lower()
    for key in sorted(BASE_IMAGES, key=len, reverse=True):
        suffix = re.fullmatch(re.escape(key) + r"-(\d+(?:-\d+)*)", name)
        if suffix:
            return key, suffix.group(1).replace("-", ".")
    found = re.match(r"\d+(\.\d+)*", tag)
    return name, found.group(0) if found else ""


def _numeric(version: str) -> str:
    """The upstream version of a Debian one or a tool's banner: ``2:1.19~1`` -> ``1.19``,
    ``go version go1.19.8 linux/amd64`` -> ``1.19.8``."""
    found = re.search(r"\d+(\.\d+)+|\d+", re.sub(r"^\d+:", "", version))
    return found.group(0) if found else version


def _matches(asked: str, have: str) -> bool:
    return not asked or have.split(".")[:len(asked.split("."))] == asked.split(".")


def base_image(ref: str, layer: str) -> Report:
    """The nearest host stand-in for the image ``ref``, its toolchain fetched into ``layer``
    as Debian packages where the sandbox's PATH lacks it; the stand-in and any version
    difference are noted."""
    name, asked = _parse_ref(ref)
    stand_in = BASE_IMAGES.get(name)
    if stand_in is None:
        return Report(notes=[f"FROM {ref}: not an image glmjax knows; the host stands in for it"])
    if stand_in.tool is None:
        return Report(notes=[f"FROM {ref}: the host (Debian {_debian_release()}) stands in for it"])
    if stand_in.tool == "python3":
        return Report(notes=[_stands_in(ref, "the sandbox's python", host_tools.PYTHON_VERSION, asked)])
    found = host_tools.command(stand_in.tool, host_tools.SYSTEM_PATH)
    if found:
        banner = subprocess.run([found, *stand_in.version_args], capture_output=True, text=True, timeout=60)
        have = _numeric(banner.stdout + banner.stderr)
        return Report(notes=[_stands_in(ref, f"the host's {stand_in.tool}", have, asked)])
    report = debian_packages(list(stand_in.packages), layer)
    first = next((i.split() for i in report.installed if i.split()[0] == stand_in.packages[0]), None)
    if first:
        report.notes.insert(0, _stands_in(ref, f"Debian's {first[0]} {first[1]}: {stand_in.tool}",
                                          _numeric(first[1]), asked))
    return report


def _stands_in(ref: str, what: str, have: str, asked: str) -> str:
    return f"FROM {ref}: {what} {have} stands in" + ("" if _matches(asked, have) else f" ({asked} asked)")


def _debian_release() -> str:
    return (host_tools._read_text("/etc/debian_version") or "?").strip()
