"""Packages from the registries, fetched at image-build time into a task's layer.

A task's image installs what it needs (``pip install PyJWT==2.8.0``, ``apt-get install jq``,
``FROM golang:1.22``). The sandbox has no network, so what the host lacks is fetched here,
outside it, through the registries this machine reaches (PyPI, Debian's archive), into the
task's *layer*: a directory of the image's files at their absolute paths
(``layer/usr/bin/jq``), laid over the host's root in the sandbox. Nothing here changes the
host's own python environment or its apt and dpkg state.

    python_packages(requirements, layer)   PyPI's, for the sandbox's interpreter (pypi.py)
    debian_packages(names, layer)          Debian's, unpacked (debian.py)
    base_image(ref, layer)                 an official image's toolchain as Debian's packages
                                           (``golang:1.22`` -> golang-go), nothing where the
                                           sandbox's PATH has the tool already (this file)

Each returns a ``Report``: what it installed, every deviation from what was asked (a
version, a substitute, the base image's stand-in) as a note, and what cannot be had,
naming the package and why. Downloads and unpacked packages are cached across tasks
(``envs/image/fetched.py``).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess

from envs.image import fetched, host_tools
from envs.image.debian import DEBIAN_STATUS, debian_packages
from envs.image.fetched import Report, cache_dir
from envs.image.pypi import BIN, SITE, python_packages

__all__ = ["BASE_IMAGES", "BIN", "DEBIAN_STATUS", "SITE", "Report", "StandIn", "base_image", "cache_dir",
           "debian_packages", "python_packages"]


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
    return (fetched.read_text("/etc/debian_version") or "?").strip()


