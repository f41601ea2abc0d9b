"""Packages fetched from PyPI and Debian's archive into a task's layer (envs/image/packages.py).

These reach the registries, as CI's machine does; one cache serves the module, so each
package is downloaded once and the second fetch of a test shows that the cache needs no
network.
"""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from envs.image import debian, host_tools, installs, packages, pypi
from envs.sandbox.sandbox import Sandbox


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cache"))
    before = os.environ.get("GLMJAX_CACHE")
    os.environ["GLMJAX_CACHE"] = path
    yield path
    if before is None:
        del os.environ["GLMJAX_CACHE"]
    else:
        os.environ["GLMJAX_CACHE"] = before


@pytest.fixture
def calls(monkeypatch):
    """The pip and apt-get command lines a test runs, recorded."""
    seen = []
    pip, apt_get = pypi._pip, debian._apt_get
    monkeypatch.setattr(pypi, "_pip", lambda args, layer: seen.append(["pip", *args]) or pip(args, layer))
    monkeypatch.setattr(debian, "_apt_get", lambda root, args: seen.append(["apt-get", *args]) or apt_get(root, args))
    return seen


def _absent(*names):
    """The first Debian package of ``names`` the host has not installed."""
    for name in names:
        if host_tools.apt_package(name, host_tools.SYSTEM_PATH)[0]:
            return name
    raise AssertionError(f"the host has every one of {names}; name another small package it lacks")


def test_python_packages_honour_pins_for_the_sandboxs_interpreter(cache, tmp_path, calls):
    assert host_tools.python_package("PyJWT")[0], "the host has PyJWT: this test needs a package it lacks"
    layer = str(tmp_path / "layer")
    report = packages.python_packages(["PyJWT==2.8.0", "python-slugify==8.0.4", "requests"], layer)
    assert report.missing == [] and {"PyJWT 2.8.0", "python-slugify 8.0.4"} <= set(report.installed), report
    assert any(n.startswith("requests ") and "present" in n for n in report.notes)  # the host's: not fetched
    assert not any(i.startswith("requests ") for i in report.installed)
    # the sandbox's interpreter imports them with SITE on its path (the guard puts it there)
    probe = f"import sys; sys.path.insert(1, {layer + packages.SITE!r}); import jwt, slugify; print(jwt.__version__)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout == "2.8.0\n"
    script = open(layer + "/usr/local/bin/slugify").read()
    assert script.startswith(f"#!{sys.executable}\n") and packages.SITE in script
    assert not os.path.exists(layer + packages.SITE + "/bin")
    assert any("--no-index" not in c for c in calls)  # the first fetch used the index

    calls.clear()
    again = packages.python_packages(["PyJWT==2.8.0", "python-slugify==8.0.4"], str(tmp_path / "second"))
    assert set(again.installed) == set(report.installed) - {i for i in report.installed if i.startswith("requests")}
    assert calls and all("--no-index" in c for c in calls), calls  # the wheel cache alone
    assert packages.python_packages(["PyJWT==2.8.0"], layer).notes == ["PyJWT 2.8.0 already in the layer"]
    # a later step's pin replaces an earlier one's in the layer, as pip would in the image
    assert packages.python_packages(["PyJWT==2.7.0"], layer).installed == ["PyJWT 2.7.0"]
    found = importlib.metadata.distributions(name="PyJWT", path=[layer + packages.SITE])
    assert [d.version for d in found] == ["2.7.0"]


def test_what_the_index_lacks_is_named_and_a_missing_pin_falls_back(cache, tmp_path):
    report = packages.python_packages(["PyJWT==0.0.99", "glmjax-no-such-distribution", "pip"], str(tmp_path))
    assert report.missing == ["python package glmjax-no-such-distribution: Could not find a version that "
                              "satisfies the requirement glmjax-no-such-distribution (from versions: none)"]
    assert any(n.startswith("PyJWT==0.0.99: that version cannot be had") for n in report.notes), report.notes
    assert any(i.startswith("PyJWT ") for i in report.installed) and "pip: the sandbox's own" in report.notes


def test_debian_packages_unpack_into_the_layer_without_touching_the_hosts_apt(cache, tmp_path, calls):
    name = _absent("figlet", "toilet", "sl")
    layer = str(tmp_path / "layer")
    status_before = os.stat("/var/lib/dpkg/status").st_mtime
    report = packages.debian_packages([name, "jq", "python3-jwt", "glmjax-no-such-package"], layer)
    assert report.missing == ["Debian package glmjax-no-such-package: Unable to locate package "
                              "glmjax-no-such-package"], report
    assert any(i.startswith(f"{name} ") for i in report.installed) and "PyJWT 2.8.0" in report.installed
    assert any(n.startswith("python3-jwt: PyPI's PyJWT") for n in report.notes)
    assert name in host_tools.layer_debian(layer + packages.DEBIAN_STATUS)
    assert os.stat("/var/lib/dpkg/status").st_mtime == status_before
    if name == "figlet":  # its postinst's alternative is the command's name; it needs only the host's libc
        assert os.readlink(layer + "/usr/bin/figlet") == "/usr/bin/figlet-figlet"
        banner = subprocess.run([layer + "/usr/bin/figlet-figlet", "-d", layer + "/usr/share/figlet", "hi"],
                                capture_output=True, text=True)
        assert banner.returncode == 0 and "|_|" in banner.stdout, banner
    assert any(c[1:2] == ["update"] for c in calls) and any("--download-only" in c for c in calls)

    calls.clear()
    again = packages.debian_packages([name], str(tmp_path / "second"))
    assert again.installed == [i for i in report.installed if i.startswith(f"{name} ")]
    assert calls and not any(c[1:2] == ["update"] or "--download-only" in c for c in calls), calls


def test_a_base_image_is_the_hosts_stand_in_or_debians_toolchain(cache, tmp_path):
    python = packages.base_image("python:3.13-slim", str(tmp_path))
    assert python.notes == [f"FROM python:3.13-slim: the sandbox's python {host_tools.PYTHON_VERSION} stands in"
                            + ("" if host_tools.PYTHON_VERSION.startswith("3.13.") else " (3.13 asked)")]
    assert packages.base_image("ubuntu:24.04", str(tmp_path)).notes[0].startswith("FROM ubuntu:24.04: the host")
    layer = str(tmp_path / "go")
    go = packages.base_image("golang:1.22", layer)
    if host_tools.command("go", host_tools.SYSTEM_PATH):
        assert go.notes[0].startswith("FROM golang:1.22: the host's go") and not go.installed
        return
    assert go.missing == [] and go.notes[0].startswith("FROM golang:1.22: Debian's golang-go "), go.notes
    assert go.notes[0].endswith(" stands in (1.22 asked)")  # bookworm's Go is 1.19
    version = subprocess.run([os.path.realpath(layer + "/usr/lib/go-1.19/bin/go"), "version"],
                             capture_output=True, text=True)
    assert version.stdout.startswith("go version go1.19"), version
    assert os.readlink(layer + "/usr/bin/go") == "../lib/go-1.19/bin/go"  # on PATH inside the sandbox


def test_a_scanned_script_is_served_by_its_layer_in_the_sandbox(cache, tmp_path):
    name = _absent("figlet", "toilet", "sl")
    script = (f"apt-get update && apt-get install -y {name} python3-jwt\npip install PyJWT==2.8.0 'pytest==8.4.1'\n"
              "python3 -c 'import jwt, pytest; print(jwt.__version__, pytest.__version__)'\n")
    scan = installs.scan(script, "tests/test.sh")
    assert scan.unsupported is None and scan.debian == [name], scan.installs
    layer = str(tmp_path / "layer")
    report = packages.debian_packages(scan.debian, layer).add(packages.python_packages(scan.python, layer))
    assert report.missing == [], report
    unfetched = "pip install glmjax-nope; echo nope=$?\napt-get install -y glmjax-nope; echo nope=$?\n"
    with Sandbox(layer=layer) as box:
        out = box.run(scan.script + unfetched).output
    assert "2.8.0 8.4.1\n" in out, out  # the pins win over the host's versions
    assert "nope=1" in out and "glmjax-nope is not installed" in out and "nope=100" in out, out
