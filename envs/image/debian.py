"""Debian packages from Debian's archive, fetched at image-build time into a task's layer.

``debian_packages(names, layer)``: apt, with a configuration, package lists and archive
cache of its own (the host's sources, keys and network settings; none of its hooks),
resolves the names against the host's dpkg status, which it never changes; each package
the host lacks (or has older than a dependency needs) is unpacked into the layer as
``dpkg-deb -x`` does and listed in ``layer/DEBIAN_STATUS`` for the sandbox's ``apt-get``.
Maintainer scripts do not run (noted), except the ``update-alternatives`` links of a
postinst. ``python3-X`` is PyPI's X (``envs/image/pypi.py``): Debian's lands in
/usr/lib/python3/dist-packages, which the sandbox's interpreter does not read. A name
Debian lacks (Ubuntu's ``chromium-browser``, another ``openjdk-N``) takes Debian's
nearest package, noted.

Cache (``envs/image/fetched.py``): ``apt/`` holds the lists (fetched again after a day),
the archives and each package unpacked once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

from envs.image import fetched, host_tools, pypi, shell_syntax

DEBIAN_STATUS = host_tools.DEBIAN_STATUS
_LISTS_MAX_AGE_S = 24 * 3600
# another distribution's name (Ubuntu's mostly) -> Debian's nearest package, tried when Debian has no such name
_SUBSTITUTES = {"chromium-browser": "chromium", "chromium-chromedriver": "chromium-driver",
                "mysql-server": "default-mysql-server", "mysql-client": "default-mysql-client",
                "linux-tools-common": "linux-perf", "linux-tools-generic": "linux-perf", "libv8-dev": "libnode-dev"}
_OTHER_JDK = re.compile(r"openjdk-\d+-(jdk|jre)(-headless)?")  # bookworm's is 17
_INST = re.compile(r"^Inst (\S+) (?:\[(\S+)\] )?\((\S+) .*\[(\S+)\]\)", re.M)


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
        return f"apt-get update failed: {fetched.last_error(result.stderr + result.stdout)}"
    open(stamp, "w").close()
    return None


def _simulate(root: str, names: list[str]) -> tuple[list[tuple[str, str, str, str]] | None, str]:
    """[(package, host's version or "", version, architecture)] apt would unpack, or (None, error)."""
    result = _apt_get(root, ["install", "-s", *names])
    if result.returncode != 0:
        return None, fetched.last_error(result.stderr + result.stdout)
    return [(p, old or "", v, a) for p, old, v, a in _INST.findall(result.stdout)], ""


def _debian_plan(root: str, names: list[str], report: fetched.Report) -> list[tuple[str, str, str, str]]:
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
                fetched.lay(os.path.join(files, top), target)
                shutil.rmtree(os.path.join(files, top))

    return fetched.once(os.path.join(root, "unpacked", os.path.basename(deb)[:-len(".deb")]), unpack)


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


def debian_packages(names: list[str], layer: str) -> fetched.Report:
    """Fetch what the host lacks of the Debian packages ``names`` into ``layer`` (see the
    module docstring)."""
    report, wanted, python = fetched.Report(), [], []
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
        report.add(pypi.python_packages(python, layer))
    if not wanted:
        return report
    with fetched.locked(os.path.join(fetched.cache_dir(), "apt")) as root:
        error = _apt_lists(root)
        if error:
            report.missing += [f"Debian package {n}: {error}" for n in wanted]
            return report
        plan = [p for p in _debian_plan(root, wanted, report) if p[0] not in present]
        if any(not os.path.exists(_archive(root, p, v, a)) for p, _, v, a in plan):
            result = _apt_get(root, ["install", "--download-only", *(f"{p}={v}" for p, _, v, _ in plan)])
            if result.returncode != 0:
                error = fetched.last_error(result.stderr + result.stdout)
                report.missing += [f"Debian package {n}: {error}" for n in wanted]
                return report
        stanzas, scripted = [], []
        for package, old, version, arch in plan:
            unpacked = _unpacked(root, _archive(root, package, version, arch))
            fetched.lay(os.path.join(unpacked, "files"), layer)
            control = fetched.read_text(os.path.join(unpacked, "control", "control")) or ""
            stanzas.append("Status: install ok installed\n" + control.strip() + "\n")
            report.installed.append(f"{package} {version}")
            if any(os.path.exists(os.path.join(unpacked, "control", n)) for n in ("preinst", "postinst")):
                links = _alternatives(fetched.read_text(os.path.join(unpacked, "control", "postinst")) or "",
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


