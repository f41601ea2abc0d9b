"""The build sandbox: a Dockerfile's ``RUN`` lines, run as root of a root whose writes land
in an image's layer and nowhere else.

A *layer* is a directory that holds what a build changed, at the paths the image has them
(``layer/usr/bin/jq``, ``layer/data.csv``), with overlayfs's whiteouts for what it removed.
``BuildRoot(layer, scratch).run(command)`` runs one step in a new root made of:

- the root itself: an overlay whose upper directory is the layer, over an empty skeleton,
  so that ``mkdir /queries`` or ``echo > /data.csv`` lands in the layer;
- over each host directory a sandbox shows (``/usr``, ``/etc``, ``/var/lib/dpkg``:
  ``isolation.root_layout``) an overlay of that directory with the layer's part of it as
  its upper directory: ``touch /usr/evil`` writes ``layer/usr/evil``, never ``/usr``. Under
  ``/etc``, a mask layer stands between the two: the host's ``shadow`` and ``gshadow``
  without their password hashes, its SSH host keys and ``/etc/ssl/private`` left out, so
  that no secret of the host can be copied into an image;
- the sandbox's tools at ``/glmjax`` and the host interpreter, read-only; a minimal
  ``/dev``; ``/proc`` with the step's own processes only (``subset=pid``: no
  ``/proc/sys``, no ``/proc/sysrq-trigger``); no ``/sys``.

Enforced for the step (``isolation.Plan(build_caps=...)``): new mount, PID, network
(its own loopback only), IPC and UTS namespaces; root with only ``isolation.BUILD_CAPS``
(Docker's default set less MKNOD, NET_RAW and AUDIT_WRITE: no CAP_SYS_ADMIN, so it
cannot mount, unmount or leave its root) and ``PR_SET_NO_NEW_PRIVS``; a ``USER`` step runs
as that uid instead; the rlimits of ``LIMITS``. Every path it can write is an upper
directory inside the layer, its own ``/dev/shm``, or nothing.

Not enforced: root's override of file permissions reaches what the host's system
directories hold (the files the mask leaves out excepted), so a step reads what is
there, as a sandbox's commands read what their modes allow; no cgroup caps the step's
memory or CPU beyond the rlimits, and no seccomp filter stands between it and the
kernel. The Dockerfile is the task author's, trusted as far as the task's tests are.
"""

from __future__ import annotations

import os
import resource
import stat
import subprocess

from envs.sandbox import isolation, launcher, tree
from envs.sandbox.results import Limits, RunResult, SandboxError
from envs.sandbox.sandbox import probe
from envs.sandbox.tools import TOOLS, interpreter_binds, tool_dir

LIMITS = Limits(wall_seconds=900.0, cpu_seconds=900, memory_bytes=8 << 30, processes=512, file_bytes=4 << 30,
                open_files=4096, output_bytes=1 << 20)
_SECRETS = ("shadow", "gshadow", "shadow-", "gshadow-")


class BuildRoot:
    """Runs build steps over ``layer``; ``scratch`` is an empty directory on the layer's
    filesystem (overlayfs keeps its work directories beside the upper ones), removed by
    ``close()``; ``extra``: binds (host directory, path inside, writable) of the builder's
    own staging directories, such as the sources of a ``COPY``."""

    def __init__(self, layer: str, scratch: str, extra: tuple[tuple[str, str, bool], ...] = ()):
        found = probe()
        if found.filesystem != "chroot" or found.processes != "pidns" or found.network != "netns":
            raise SandboxError(f"a build step needs root, and mount, PID and network namespaces; this machine "
                               f"allows {found.describe()}")
        self.layer, self.scratch = os.path.realpath(layer), os.path.realpath(scratch)
        self.skeleton = os.path.join(self.scratch, "skeleton")
        self.mount_point = os.path.join(self.scratch, "root")
        for path in (self.skeleton, self.mount_point):
            os.makedirs(path, exist_ok=True)
        os.makedirs(os.path.join(self.skeleton, "tmp"), exist_ok=True)  # an image's /tmp, as Docker's base images have
        os.chmod(os.path.join(self.skeleton, "tmp"), 0o1777)
        self.mounts: list = [(isolation.Overlay((self.skeleton,), self.layer, self._work("root")), "/", True)]
        for path, kind in sorted(isolation.root_layout().items()):
            if kind != "host":
                continue
            upper = self.layer + path
            if os.path.lexists(upper) and not (os.path.isdir(upper) and not os.path.islink(upper)):
                raise SandboxError(f"the layer holds {path} as something other than a directory")
            os.makedirs(upper, exist_ok=True)
            lowers = (self._mask_etc(), path) if path == "/etc" else (path,)
            self.mounts.append((isolation.Overlay(lowers, upper, self._work(path)), path, True))
        self.mounts += [(tool_dir(), TOOLS, False), *interpreter_binds(), *extra]

    def _work(self, path: str) -> str:
        work = os.path.join(self.scratch, "work", path.strip("/").replace("/", "_") or "root")
        os.makedirs(work, exist_ok=True)
        return work

    def _mask_etc(self) -> str:
        """The layer between the host's ``/etc`` and the build's: its password files without
        hashes, its private keys hidden (whiteouts, an opaque empty directory)."""
        mask = os.path.join(self.scratch, "mask-etc")
        if os.path.isdir(mask):
            return mask
        os.makedirs(mask)
        for name in _SECRETS:
            host = os.path.join("/etc", name)
            if not os.path.isfile(host):
                continue
            with open(host, errors="replace") as f:
                lines = [line.rstrip("\n").split(":") for line in f if line.strip()]
            with open(os.path.join(mask, name), "w") as f:
                f.writelines(":".join(fields[:1] + ["*"] + fields[2:]) + "\n" for fields in lines)
            os.chmod(os.path.join(mask, name), stat.S_IMODE(os.stat(host).st_mode))
        ssh = "/etc/ssh"
        keys = [n for n in (os.listdir(ssh) if os.path.isdir(ssh) else []) if "key" in n and not n.endswith(".pub")]
        if keys:
            os.makedirs(os.path.join(mask, "ssh"))
            for name in keys:
                os.mknod(os.path.join(mask, "ssh", name), stat.S_IFCHR, os.makedev(0, 0))  # a whiteout
        if os.path.isdir("/etc/ssl/private"):
            os.makedirs(os.path.join(mask, "ssl", "private"))
            os.setxattr(os.path.join(mask, "ssl", "private"), "trusted.overlay.opaque", b"y")
        return mask

    def run(self, command: str, *, env: dict[str, str], cwd: str = "/", uid: int | None = None,
            shell: tuple[str, ...] = ("/bin/sh", "-c"), stdin: str | None = None,
            limits: Limits = LIMITS) -> RunResult:
        """Run ``command`` with ``shell`` (Docker's ``SHELL``) as root, or as ``uid`` (a
        ``USER`` step), in ``cwd``; never raises for what the command does."""
        rlimits = [(resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, limits.memory_bytes),
                   (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_NOFILE, limits.open_files),
                   (resource.RLIMIT_CORE, 0)]
        plan = isolation.Plan(root=self.mount_point, uid=uid, network_ns=True, chroot=True, pid_ns=True, ipc_ns=True,
                              rlimits=rlimits, cwd=cwd, mounts=tuple(self.mounts), build_caps=isolation.BUILD_CAPS)
        try:
            returncode, output, killed, truncated, seconds = launcher.call(
                "run", argv=[*shell, command], env=env, plan=plan, stdin=stdin.encode() if stdin else None,
                wall_seconds=limits.wall_seconds, output_bytes=limits.output_bytes)
        except (subprocess.SubprocessError, launcher.HelperDied) as err:
            raise SandboxError(f"could not start a build step: {err}") from err
        return RunResult(returncode, output.decode("utf-8", errors="replace"), seconds, killed, truncated)

    def close(self) -> None:
        tree.rmtree(self.scratch)

    def __enter__(self) -> "BuildRoot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
