"""An image's layer laid over a sandbox's root (``Sandbox(layer=...)``).

The layer (``envs/sandbox/build.py`` writes it) holds what an image's build changed at
the paths the image has them. ``graft`` turns it into mounts of the sandbox's new root,
walking it against what the root holds (``isolation.root_layout``):

    the root holds           the layer holds             mounted there
    a host directory         a directory                 a read-only overlay: the layer's
      (/usr, /etc, ...)                                    part above the host's (its
                                                           whiteouts hide host files)
    a directory of its own   a directory                 nothing: its entries in turn
      (/, /opt, /var, ...)
    nothing                  a directory, a file         a read-only bind of it
                             a symbolic link             the link, resolved inside the root
    a link (/bin, /var/tmp)  anything                    nothing (a build writes through it)

Everything is read-only: the agent's uid could not write what a root build made there
anyway, and a layer shared by every episode of a task must not change. ``skip``: paths
the sandbox fills itself (its own directories, tools, interpreter), never taken from a
layer; a whiteout where the root holds nothing hides nothing and is left out.
"""

from __future__ import annotations

import os
import posixpath
import stat

from envs.sandbox import isolation


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def graft(layer: str, skip: tuple[str, ...]) -> tuple[tuple[object, str, bool], ...]:
    """The mounts (source, path inside, writable) that lay ``layer`` over a sandbox's root."""
    layout, mounts = isolation.root_layout(), []

    def visit(path: str) -> None:
        for name in sorted(os.listdir(layer + path)):
            inside, source = posixpath.join(path, name), layer + posixpath.join(path, name)
            if any(_under(inside, s) for s in skip):
                continue
            st, kind = os.lstat(source), layout.get(inside)
            is_dir = stat.S_ISDIR(st.st_mode)
            if kind == "link" or stat.S_ISCHR(st.st_mode) and kind != "host":
                continue
            if kind == "host":
                if is_dir and os.listdir(source):
                    mounts.append((isolation.Overlay((source, inside)), inside, False))
            elif kind == "dir" or is_dir and any(_under(s, inside) for s in skip):
                if is_dir:
                    visit(inside)
            elif stat.S_ISLNK(st.st_mode):
                mounts.append((isolation.Symlink(os.readlink(source)), inside, False))
            elif is_dir or stat.S_ISREG(st.st_mode):
                mounts.append((source, inside, False))

    if layer and os.path.isdir(layer):
        visit("/")
    return tuple(mounts)


def named_user(name: str, uid: int, layer: str | None, out: str) -> tuple[tuple[str, str, bool], ...]:
    """Binds of ``/etc/passwd`` and ``/etc/group`` (the layer's, else the host's), written
    under ``out``, in which ``name`` is ``uid``: the image's user is the sandbox's."""
    mounts = []
    for table, fields in (("passwd", 7), ("group", 4)):
        source = next((p for p in (f"{layer}/etc/{table}" if layer else "", f"/etc/{table}")
                       if p and os.path.isfile(p) and not os.path.islink(p)), None)
        with open(source, errors="replace") if source else open(os.devnull) as f:
            rows = [line.rstrip("\n").split(":") for line in f if line.strip()]
        rows = [r for r in rows if r[0] != name and (len(r) < 3 or r[2] != str(uid))]
        home = f"/home/{name}"
        rows.append([name, "x", str(uid), str(uid), "", home, "/bin/bash"] if table == "passwd" else
                    [name, "x", str(uid), ""])
        path = os.path.join(out, table)
        with open(path, "w") as f:
            f.writelines(":".join(r[:fields] if len(r) >= fields else r) + "\n" for r in rows)
        os.chmod(path, 0o644)
        mounts.append((path, f"/etc/{table}", False))
    return tuple(mounts)

