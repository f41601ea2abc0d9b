"""What the host offers a sandbox in place of a task image's packages, and the stand-in
package managers that run inside the sandbox.

A Harbor task's Dockerfile and test script install what they need (``apt-get install jq``,
``pip install pytest==8.4.1``, the uv installer, ``uvx -w pytest==8.4.1 pytest ...``).
Without Docker and without a network, an install is *resolved* instead: it is satisfied
when the host already has what it asks for, and fails, naming what is missing, when not.

- ``apt_package(name)``: installed per dpkg, or a command of that name on the sandbox's
  PATH, or (``python3-X``) the Python distribution/module X, or a known alias
  (``build-essential`` -> gcc, g++, make);
- ``python_package(requirement)``: the distribution is installed for the sandbox's python
  (the interpreter running glmjax); a different pinned version is accepted and noted;
- the stand-ins, run as ``apt-get`` (``apt``, ``apk``, ``yum``, ``dnf``), ``pip``, ``pip3``,
  ``uv`` and ``uvx`` inside the sandbox (``main``): installs are checked as above and otherwise do nothing; ``uvx TOOL``
  and ``uv run CMD`` run the host's tool (``pytest`` is pytest's console script; under ``uvx``,
  as in its fresh environment, pytest loads only the plugins of the ``--with`` packages).

``build(root)`` writes the tool directory a sandbox mounts at ``/glmjax``: ``bin/`` (the
stand-ins; ``python``/``python3``, the host interpreter; ``pytest``), ``lib/`` (this file)
and ``guard/``, the first directory on the ``PYTHONPATH`` of every ``python`` started
through ``bin/`` (and of the pythons those start with their environment). Guaranteed there,
against files the agent leaves where the verifier's python looks:

- its ``sitecustomize`` is the one imported (``usercustomize``: the user site is off), and
  what python imports while it starts (``encodings``, what ``.pth`` files import) comes from
  its own directories: ``PYTHONPATH``'s entries join sys.path only once the guard runs;
- a top-level module comes from the directories the agent cannot write (the interpreter's
  own, ``$TEST_DIR``) when one of them has it, and only otherwise along sys.path: a
  ``pytest.py``, ``re.py`` or ``unittest/`` in ``/app`` never stands in for the real one,
  whether ``/app`` is on sys.path as the working directory (``python3 -m pytest``), on
  ``PYTHONPATH`` or through the test's own ``sys.path.insert(0, "/app")``, while the agent's
  modules (``from solution import f``) import as in the task's image, sys.path in its order;
- ``pytest``, ``uvx pytest`` and ``uv run pytest`` start pytest's console script: nothing of
  the working directory on sys.path, and pytest's rootdir, ini file and conftests found from
  the test paths, as in the image (an ``/app/pytest.ini`` or ``/app/conftest.py`` is not read
  for ``/tests/test_outputs.py``).

Not covered: a python started with ``-E``, ``-I`` or ``-S``, or by its path
(``/usr/bin/python3``) from an environment without the guard on ``PYTHONPATH``; the modules
a python started by ``sys.executable`` imports while it starts, from an agent's directory
on ``PYTHONPATH``. An agent's module named like one of the host's site-packages (a larger set
than an image's) is not importable under that name.

This file is copied into the sandbox and run there by the host interpreter: it imports
only the standard library.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STAND_INS = ("apt-get", "apt", "apk", "yum", "dnf", "pip", "pip3", "uv", "uvx")
_ALIASES = {  # apt package -> the commands (or "/path" files, "py:module" modules) that stand for it
    "build-essential": ("gcc", "g++", "make"), "python3-pip": ("pip3",), "python-is-python3": ("python",),
    "python3-venv": ("py:venv",), "python3-dev": ("py:sysconfig",), "ca-certificates": ("/etc/ssl/certs",),
    "procps": ("ps",), "iproute2": ("ip",), "net-tools": ("netstat",), "openssh-client": ("ssh",),
    "dnsutils": ("dig",), "iputils-ping": ("ping",), "coreutils": ("ls",), "findutils": ("find",),
    "gnupg": ("gpg",), "xz-utils": ("xz",), "bzip2": ("bzip2",), "locales": ("locale",),
    "software-properties-common": (), "apt-transport-https": (), "apt-utils": (),
    "asciinema": (),  # Terminal-Bench's harness records sessions with it; tasks never use it
}
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^]]*\])?\s*(.*)$")
# what envs/image/packages.py fetched into the task's layer, at their paths in the sandbox
SITE = "/opt/glmjax/python/site-packages"  # python packages, before the interpreter's own on sys.path
DEBIAN_STATUS = "/opt/glmjax/debian/status"  # Debian packages unpacked into the layer (dpkg's format)
PYPI_NAMES = {  # Debian's python3-X -> the PyPI distribution, where X is not its name
    "yaml": "PyYAML", "bs4": "beautifulsoup4", "dateutil": "python-dateutil", "pil": "pillow",
    "sklearn": "scikit-learn", "jwt": "PyJWT", "opencv": "opencv-python", "crypto": "pycryptodome",
    "serial": "pyserial", "magic": "python-magic", "dotenv": "python-dotenv", "docx": "python-docx",
    "pptx": "python-pptx", "levenshtein": "Levenshtein", "tz": "pytz", "zmq": "pyzmq", "gi": "PyGObject",
    "usb": "pyusb", "nacl": "PyNaCl", "openssl": "pyOpenSSL", "jose": "python-jose", "ldap": "python-ldap",
}
PYTHON_VERSION = ".".join(map(str, sys.version_info[:3]))


def same_python(asked: str) -> bool:
    """Whether a requested python (``3.13``, ``python3.11``, ``>=3.10``) is the sandbox's."""
    found = re.search(r"(\d+)\.(\d+)", asked)
    return found is None or (int(found.group(1)), int(found.group(2))) == sys.version_info[:2]


# ----- resolution --------------------------------------------------------------------------------
def normal_name(name: str) -> str:
    """A distribution's name as PyPI compares names (``PyJWT``, ``pyjwt``, ``Py_JWT``: one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution(name: str) -> importlib.metadata.Distribution:
    """The distribution ``name`` as the sandbox's python sees it: the layer's (``SITE``) first."""
    for dist in importlib.metadata.distributions(name=name, path=[SITE]) if os.path.isdir(SITE) else ():
        return dist
    return importlib.metadata.distribution(name)


def pypi_name(debian: str) -> str | None:
    """The PyPI distribution of Debian's ``python3-X`` (None for another package)."""
    if not debian.startswith("python3-") or len(debian) <= 8:
        return None
    return PYPI_NAMES.get(debian[8:], debian[8:])


def python_package(requirement: str) -> tuple[str | None, str]:
    """(missing name or None, a note) for one requirement (``pytest==8.4.1``, ``numpy>=2``)."""
    found = _REQUIREMENT.match(requirement)
    if not found:
        return requirement, f"{requirement!r} is not a requirement glmjax can resolve"
    name, spec = found.group(1), found.group(3).strip()
    if normal_name(name) in ("uv", "pip", "setuptools", "wheel"):
        return None, f"{name}: provided by the sandbox"
    try:
        dist = _distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return name, f"python package {name} is not installed for the sandbox's python ({sys.executable})"
    version, where = dist.version, " in the layer" if str(dist.locate_file("")).startswith(SITE) else ""
    pinned = re.fullmatch(r"==\s*([^,;\s]+)", spec)
    if pinned and pinned.group(1) != version:
        return None, f"{name}: {version} present{where} ({pinned.group(1)} asked)"
    return None, f"{name} {version} present{where}"


def command(name: str, path: str | None = None) -> str | None:
    """Where ``name`` is on ``path`` (default: this process's PATH, the sandbox's inside it)."""
    return shutil.which(name, path=path or os.environ.get("PATH", SYSTEM_PATH))


def _dpkg_installed(name: str) -> str | None:
    if not shutil.which("dpkg-query"):
        return None
    result = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Status} ${Version}", name],
                            capture_output=True, text=True)
    status, _, version = result.stdout.partition(" ")
    return version if result.returncode == 0 and status == "installed" else None


def layer_debian(status: str = DEBIAN_STATUS) -> dict[str, str]:
    """{package: version} of the Debian packages unpacked into the layer (``DEBIAN_STATUS``)."""
    text = _read_text(status) or ""
    stanzas = [dict(re.findall(r"^([\w-]+):\s*(.*)$", s, re.M)) for s in text.split("\n\n")]
    return {s["Package"]: s.get("Version", "") for s in stanzas if "Package" in s}


def apt_package(name: str, path: str | None = None) -> tuple[str | None, str]:
    """(missing name or None, a note) for one system package (``jq``, ``python3-numpy=1:1.24``)."""
    name = name.split("=")[0].split(":")[0]
    needs = _ALIASES.get(name)
    if needs is None and pypi_name(name):
        # the sandbox's python3 is the host interpreter, not the system python dpkg serves
        module, dist = name[8:], pypi_name(name)
        if importlib.util.find_spec(module.replace("-", "_")) is not None or python_package(dist)[0] is None:
            return None, f"{name}: python module {module} present"
        return name, f"{name}: python module {module} is not installed for the sandbox's python3 ({sys.executable})"
    version, where = _dpkg_installed(name), "on the host"
    if not version:
        version, where = layer_debian().get(name), "in the layer"
    if version:
        return None, f"{name} {version} installed {where}"
    needs = (name,) if needs is None else needs
    for need in needs:
        if need.startswith("/"):
            present = os.path.exists(need)
        elif need.startswith("py:"):
            present = importlib.util.find_spec(need[3:]) is not None
        else:
            present = command(need, path) is not None
        if not present:
            return name, f"{name} is not on this host (no dpkg package, no {need.removeprefix('py:')})"
    if not needs:
        return None, f"{name}: not needed here"
    return None, f"{name}: {', '.join(n.removeprefix('py:') for n in needs)} present"


# ----- the stand-ins (run inside the sandbox) ------------------------------------------------------
_PIP_FLAGS_WITH_VALUE = {"-i", "--index-url", "--extra-index-url", "-c", "--constraint", "--root-user-action",
                         "--progress-bar", "-t", "--target", "--python", "-p", "--prefix", "--cache-dir", "-f",
                         "--find-links", "--trusted-host", "--python-version", "--platform", "--retries", "--timeout",
                         "--log", "--proxy", "--src", "--cert", "--client-cert", "--exists-action",
                         "--upgrade-strategy", "--implementation", "--abi", "--report", "-C", "--config-settings",
                         "--global-option", "--no-binary", "--only-binary", "--root", "--keyring-provider",
                         "--resolution", "--index-strategy", "--extra-index"}


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def pip_requirements(args: list[str], read=_read_text) -> tuple[list[str], list[str]]:
    """(requirements, unresolvable sources) of ``pip install ARGS``; ``-r`` files are read
    with ``read(path) -> text or None``."""
    reqs, sources, it = [], [], iter(args)
    for arg in it:
        if arg in ("-r", "--requirement") or arg.startswith(("--requirement=", "-r")) and arg != "-r":
            path = next(it, "") if arg in ("-r", "--requirement") else arg.split("=", 1)[-1] if "=" in arg else arg[2:]
            text = read(path)
            if text is None:
                sources.append(f"-r {path} (file not found)")
                continue
            words = [w for ln in text.splitlines() for w in ln.split("#", 1)[0].split() if w != "\\"]  # a continuation
            more, bad = pip_requirements(words, read)
            reqs, sources = reqs + more, sources + bad
        elif arg in _PIP_FLAGS_WITH_VALUE:
            next(it, None)
        elif arg in ("-e", "--editable"):
            sources.append(f"-e {next(it, '')} (an editable install of a local project)")
        elif arg.startswith("-"):
            continue
        elif "://" in arg or arg.startswith((".", "/", "git+")) or arg.endswith((".whl", ".tar.gz", ".zip")):
            sources.append(f"{arg} (a local path or URL)")
        else:
            reqs.append(arg)
    return reqs, sources


def _check(missing_notes: list[tuple[str | None, str]], tool: str) -> int:
    missing = [n for n, _ in missing_notes if n]
    for name, note in missing_notes:
        if name:
            print(f"{tool}: {note}; the sandbox has no network to install it", file=sys.stderr)
    return 1 if missing else 0


def apt_packages(args: list[str]) -> list[str] | None:
    """The packages ``apt-get ARGS`` (or apk/yum/dnf) installs; None for other actions
    (update, upgrade, clean, ...), which have nothing to do against the host."""
    words, it = [], iter(args)
    for arg in it:
        if arg in ("-o", "-t", "-c", "--option", "--target-release", "--config-file"):
            next(it, None)
        elif not arg.startswith("-"):
            words.append(arg)
    return words[1:] if words[:1] in (["install"], ["add"]) else None


def _apt(args: list[str]) -> int:
    names = apt_packages(args)
    return 100 if names and _check([apt_package(n) for n in names], "apt-get") else 0


def _pip(args: list[str]) -> int:
    if args[:1] == ["install"]:
        reqs, sources = pip_requirements(args[1:])
        for source in sources:
            print(f"pip: cannot install {source} without a network", file=sys.stderr)
        return 1 if sources or _check([python_package(r) for r in reqs], "pip") else 0
    if args[:1] == ["uninstall"]:
        return 0
    return subprocess.call([sys.executable, "-m", "pip", *args])


def _tool(name: str) -> str:
    """The tool directory's ``bin/NAME`` (see ``build``; this file runs from its ``lib/``)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bin", name)


def _tool_argv(tool: str, args: list[str]) -> list[str]:
    name = re.split(r"[=<>@\[]", tool, maxsplit=1)[0]
    if name in ("pytest", "py.test"):  # the console script, as uvx and uv run start it (not python -m pytest)
        return [_tool("pytest"), *args]
    if name in ("python", "python3") or re.fullmatch(r"python3\.\d+", name):
        return [_tool("python3"), *args]
    found = command(name)
    if not found:
        raise FileNotFoundError(f"{name} is not available in this sandbox (no network to fetch it)")
    return [found, *args]


def uv_options(args: list[str], with_flags=("-w", "--with")) -> tuple[list[str], list[str]]:
    """(requirements from --with, the remaining args from the first positional on)."""
    withs, i = [], 0
    value_flags = {"-p", "--python", "--from", "--index-url", "--extra-index-url", "--cache-dir", "--directory",
                   "--project", "--env-file", "--with-requirements", "--python-preference"}
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return withs, args[i + 1:]
        if arg in with_flags:
            withs += args[i + 1].split(",") if i + 1 < len(args) else []
            i += 2
        elif any(arg.startswith(f + "=") for f in with_flags):
            withs += arg.split("=", 1)[1].split(",")
            i += 1
        elif arg in value_flags:
            i += 2
        elif arg.startswith("-"):
            i += 1
        else:
            return withs, args[i:]
    return withs, []


def _exec(argv: list[str]) -> int:
    try:
        os.execv(argv[0], argv)
    except OSError as err:
        print(f"cannot run {argv[0]}: {err}", file=sys.stderr)
        return 127


def _uvx(args: list[str]) -> int:
    withs, rest = uv_options(args)
    if not rest:
        print("uvx: no tool named", file=sys.stderr)
        return 2
    if _check([python_package(w) for w in withs], "uvx"):
        return 1
    if re.split(r"[=<>@\[]", rest[0], maxsplit=1)[0] in ("pytest", "py.test"):
        _only_plugins(withs)
    try:
        return _exec(_tool_argv(rest[0], rest[1:]))
    except FileNotFoundError as err:
        print(f"uvx: {err}", file=sys.stderr)
        return 2


def pytest_plugins(requirements) -> list[str]:
    """The pytest plugin modules (``pytest11`` entry points) of the distributions named."""
    plugins = []
    for requirement in requirements:
        found = _REQUIREMENT.match(requirement)
        try:
            points = _distribution(found.group(1)).entry_points if found else ()
        except importlib.metadata.PackageNotFoundError:
            continue
        plugins += [ep.value.split(":")[0] for ep in points if ep.group == "pytest11"]
    return list(dict.fromkeys(plugins))


def _only_plugins(requirements: list[str]) -> None:
    """As in uvx's fresh environment, pytest loads only the plugins of the packages asked
    for with ``--with`` (not every plugin the host has installed)."""
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    plugins = pytest_plugins(requirements)
    if plugins:
        extra = " ".join(f"-p {p}" for p in plugins)
        os.environ["PYTEST_ADDOPTS"] = f"{os.environ.get('PYTEST_ADDOPTS', '')} {extra}".strip()


def _uv(args: list[str]) -> int:
    sub, rest = (args[0], args[1:]) if args else ("", [])
    if sub == "run":
        withs, cmd = uv_options(rest)
        if _check([python_package(w) for w in withs], "uv run"):
            return 1
        if not cmd:
            return 0
        try:
            return _exec(_tool_argv(cmd[0], cmd[1:]))
        except FileNotFoundError as err:
            print(f"uv run: {err}", file=sys.stderr)
            return 2
    if sub == "tool" and rest[:1] == ["run"]:
        return _uvx(rest[1:])
    if sub == "add":
        return _check([python_package(r) for r in rest if not r.startswith("-")], "uv add")
    if sub == "pip":
        return _pip(rest)
    if sub == "venv":
        target = next((a for a in rest if not a.startswith("-")), ".venv")
        os.makedirs(os.path.join(target, "bin"), exist_ok=True)
        with open(os.path.join(target, "bin", "activate"), "w") as f:
            f.write("# the sandbox's python stands in for this environment\n")
        return 0
    if sub in ("init", "sync", "lock", "self", "cache", "python", "--version", "version"):
        return 0
    print(f"uv {sub}: not supported in the sandbox", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    name, args = os.path.basename(argv[0]), argv[1:]
    if name in ("apt-get", "apt", "apk", "yum", "dnf"):
        return _apt(args)
    if name in ("pip", "pip3"):
        return _pip(args)
    if name == "uvx":
        return _uvx(args)
    if name == "uv":
        return _uv(args)
    print(f"{name}: not a glmjax stand-in", file=sys.stderr)
    return 2


# ----- the tool directory (host side) ----------------------------------------------------------------
_PYTEST_MAIN = "import sys; from pytest import console_main; sys.exit(console_main())"
# guard/sitecustomize.py (the module docstring says what it guarantees). An import finder rather than a
# reordered sys.path: tests put /app first themselves (sys.path.insert) and pytest inserts its rootdirs after
# the guard has run, and sys.path stays as in the task's image, so the agent's modules import as there.
_GUARD = '''"""The sandbox's guard (envs/image/host_tools.py): modules first from where the agent cannot write."""
import os
import sys
from importlib.machinery import PathFinder


def _abs(entry):
    try:
        return os.path.abspath(entry)  # "" is the working directory at the time of the import
    except OSError:  # the working directory is gone
        return entry


def _entries(value):
    return [_abs(p) for p in value.split(os.pathsep)] if value else []


_HERE = os.path.dirname(_abs(__file__))
_TESTS = _abs(os.environ.get("TEST_DIR", "/tests"))
# the task layer's python packages (envs/image/packages.py; host_tools.SITE): after the standard library and
# before the interpreter's own site-packages, so that a version the task pins wins; trusted as those are
_SITE = "/opt/glmjax/python/site-packages"
if os.path.isdir(_SITE) and _SITE not in sys.path:
    sys.path.insert(next((i for i, p in enumerate(sys.path) if str(p).endswith("-packages")), len(sys.path)), _SITE)
# the interpreter's own directories; a python started without the tools' wrapper has PYTHONPATH's there too
_TRUSTED = {_abs(p) for p in sys.path if isinstance(p, str)} - (set(_entries(os.environ.get("PYTHONPATH"))) - {_HERE})
_asked = os.environ.pop("GLMJAX_PYTHONPATH", None)  # PYTHONPATH as the command gave it to the wrapper
if _asked:
    _at = next((i + 1 for i, p in enumerate(sys.path) if isinstance(p, str) and _abs(p) == _HERE), 0)
    sys.path[_at:_at] = [p for p in dict.fromkeys(_entries(_asked)) if p != _HERE]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.environ.get("PYTHONPATH", _HERE)] + [p for p in _asked.split(os.pathsep) if _abs(p) != _HERE])


def _trusted(entry):
    if not isinstance(entry, str):
        return False
    path = _abs(entry)
    return path in _TRUSTED or path == _TESTS or path.startswith(_TESTS + os.sep)


class TrustedFirst:
    """A top-level module from the trusted entries of sys.path if one of them has it; a
    submodule is found through its package's __path__, where the package came from."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is not None:
            return None
        return PathFinder.find_spec(name, [e for e in sys.path if _trusted(e)])


sys.meta_path.insert(sys.meta_path.index(PathFinder) if PathFinder in sys.meta_path else 0, TrustedFirst)
'''


def build(root: str, interpreter: str = sys.executable) -> None:
    """Write the tool directory into ``root`` (see the module docstring)."""
    bin_dir, lib_dir, guard = (os.path.join(root, d) for d in ("bin", "lib", "guard"))
    for d in (bin_dir, lib_dir, guard):
        os.makedirs(d, exist_ok=True)
    shutil.copyfile(os.path.abspath(__file__), os.path.join(lib_dir, "host_tools.py"))
    usercustomize = '"""Found first on the path: a planted module of this name is never imported."""\n'
    for module, text in (("sitecustomize", _GUARD), ("usercustomize", usercustomize)):
        with open(os.path.join(guard, f"{module}.py"), "w") as f:
            f.write(text)
    here = 'd=$(dirname "$0")'
    # PYTHONPATH's own entries wait in GLMJAX_PYTHONPATH until the guard has run (it puts them back):
    # what python imports while it starts (encodings, the modules .pth files import) comes from its own directories
    python = (f'#!/bin/sh\n{here}\nGLMJAX_PYTHONPATH="${{PYTHONPATH-}}" PYTHONPATH="$d/../guard" PYTHONNOUSERSITE=1 '
              f'exec {interpreter} "$@"\n')
    # pytest's console script, as pip writes it, puts nothing of the working directory on sys.path (-P)
    pytest = f'#!/bin/sh\n{here}\nexec "$d/python3" -P -c {shlex.quote(_PYTEST_MAIN)} "$@"\n'
    scripts = {"python": python, "python3": python, "pytest": pytest, "py.test": pytest}
    for tool in STAND_INS:
        scripts[tool] = f'#!/bin/sh\n{here}\nexec {interpreter} -Es "$d/../lib/host_tools.py" "$0" "$@"\n'
    for name, text in scripts.items():
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
