"""The tools a sandbox mounts at ``TOOLS`` (what a task image would have installed:
``envs/image/host_tools.py``), and the host interpreter's prefixes that they run from."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading

from envs.image import host_tools
from envs.sandbox import anchor, tree
from envs.sandbox.isolation import VIRTUAL_DIRS
from envs.sandbox.results import SandboxError

TOOLS = "/glmjax"  # where the tool directory is mounted under chroot
_SYSTEM_TOPS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_TOOL_DIR: str | None = None
_LOCK = threading.Lock()


def tool_dir() -> str:
    """The host directory a sandbox mounts at ``TOOLS`` (``envs/image/host_tools.py`` builds
    it, with ``limits.sh``, the script that takes an agent command's limits:
    ``anchor.LIMITS_SCRIPT``), made once per machine for this interpreter and this version
    of the tools."""
    global _TOOL_DIR
    with _LOCK:
        if _TOOL_DIR is None:
            with open(host_tools.__file__, "rb") as f:
                key = hashlib.sha256(f.read() + anchor.LIMITS_SCRIPT.encode() + sys.executable.encode()).hexdigest()[:16]
            final = os.path.join(tempfile.gettempdir(), f"glmjax-tools-{key}")
            if not os.path.isdir(final):
                staging = tempfile.mkdtemp(prefix=f"glmjax-tools-{key}.")
                host_tools.build(staging)
                with open(os.path.join(staging, "limits.sh"), "w") as f:
                    f.write(anchor.LIMITS_SCRIPT)
                os.chmod(staging, 0o755)
                try:
                    os.rename(staging, final)
                except OSError:  # another process made it first
                    tree.rmtree(staging)
            _TOOL_DIR = final
        return _TOOL_DIR


def interpreter_binds() -> tuple[tuple[str, str, bool], ...]:
    """The host interpreter's prefixes, mounted read-only at their own paths so that the
    tools' ``python3`` runs inside the new root (those under a system directory are there
    already). A prefix under ``/tmp`` (a CI runner's virtualenv) is mounted there too, over
    a directory of the sandbox's ``/tmp``; one under another sandbox directory cannot be."""
    dirs = dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable)))
    dirs = [d for d in dirs if not d.startswith(_SYSTEM_TOPS)]
    for d in dirs:
        top = next((v for v in VIRTUAL_DIRS if d == v or d.startswith(v + "/")), None)
        if top not in (None, "/tmp") or d == "/tmp":
            raise SandboxError(f"the sandbox's python ({sys.executable}, prefix {d}) is under {top or d}, which "
                               f"every sandbox replaces with its own directory, so no command could run it; install "
                               f"glmjax into an interpreter elsewhere (a virtualenv under /opt, /srv or your home)")
    return tuple((d, d, False) for d in dirs if not any(d != o and d.startswith(o + "/") for o in dirs))
