"""An episode's anchor: init of the sandbox's namespaces, and the process that starts every
agent command of the episode inside them, as a container's shim does for ``docker exec``.

A command that makes its own namespaces and root pays for them every time: a network
namespace, a mount namespace with a score of binds, a PID namespace, a cgroup to join
(``cgroup.procs`` waits for an RCU grace period), and a Python fork at each step. The
anchor pays once per episode (``isolation.Plan.anchor`` makes it, from a helper): it is
PID 1 of the episode's PID namespace, lives in its network, UTS, IPC and mount namespaces
and its new root, and sits in the sandbox's cgroup with ``PR_SET_NO_NEW_PRIVS`` set. A
command is then one ``fork`` of this small process: the child takes the caller's pipes,
its own session, the command's rlimits and the sandbox's uid, and ``exec``s. Everything
it starts inherits the namespaces and the cgroup.

After a command, when no other command of the episode is running, the anchor ends what it
left: every process of the namespace but itself (``kill(-1)`` from init), the System V
IPC objects of the episode's IPC namespace and the files of its ``/dev/shm``. POSIX
message queues (there is no ``/dev/mqueue`` to list them) last until the episode ends.

Protocol (``run``, the caller's side; ``serve``, the anchor's): the caller connects to the
anchor's socket (beside its uid's lock, in a directory of mode 0700: only root reaches it,
and no sandbox sees it), sends a 4-byte length with the pipes' descriptors (``SCM_RIGHTS``:
stdin's read end or none, the output's write end), then the request as a pickle. The
anchor answers ``("started", pid)`` or ``("error", why)``, then ``("exit", status)`` (a
``waitpid`` status) when the command has exited and what it left is gone. ``b"k"`` from
the caller kills everything in the namespace (the command's deadline or output cap).

This file runs in the anchor, a fork of a helper (``envs/sandbox/launcher.py``): it
imports only the standard library and ``envs.sandbox.isolation``.
"""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import socket
import struct
import time

from envs.sandbox import isolation

_HEADER = struct.Struct("<I")
_KILL = b"k"


# ----- the anchor's side ------------------------------------------------------------------------
def start(plan: isolation.Plan, owner: int, path: str) -> int:
    """Fork an episode's anchor from this process (a helper): it listens at ``path``, makes
    ``plan``'s namespaces and root (``Plan.anchor``) and serves until ``owner`` (the
    sandbox's process) exits. Returns its host pid once it is ready; raises OSError with
    its reason when it fails."""
    read, write = os.pipe2(os.O_CLOEXEC)
    child = os.fork()
    if child == 0:
        try:
            os.close(read)
            owner_fd = os.pidfd_open(owner)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(64)
            plan.anchor(write)  # returns in the new PID namespace's init, inside the new root
            os.write(write, b"ready\n")
            keep = sorted((owner_fd, listener.fileno()))
            os.closerange(0, keep[0])
            os.closerange(keep[0] + 1, keep[1])
            os.closerange(keep[1] + 1, 1 << 16)
            for _ in range(3):  # 0, 1 and 2 taken, so that a command's pipes never arrive there
                os.open(os.devnull, os.O_RDWR)
            serve(listener, owner_fd, own_ipc=plan.ipc_ns)
        except BaseException as err:
            os.write(write, f"error {type(err).__name__}: {err}\n".encode()[:4096])
        os._exit(1)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 4096):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(child, 0)
    words = dict(line.split(" ", 1) if " " in line else (line, "") for line in b"".join(chunks).decode().splitlines())
    if "error" in words or "ready" not in words or "pid" not in words:
        raise OSError(f"the sandbox's namespaces could not be made: {words.get('error', 'no reply')}")
    return int(words["pid"])


def serve(listener: socket.socket, owner_fd: int, own_ipc: bool) -> None:
    """The anchor's loop (never returns): start commands, reap, end what each left, report;
    exit (ending the namespace and everything in it) when the owner's process does.
    ``own_ipc``: the episode has an IPC namespace of its own, whose objects it clears (in
    the host's, they are the sandbox's to remove when it closes)."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent's uid may signal init; only handled signals arrive
    listener.setblocking(False)
    clients: dict[int, socket.socket] = {}  # descriptor -> connection
    running: dict[int, socket.socket] = {}  # pid of a command -> its caller's connection
    exits: list[tuple[int, int]] = []  # (pid, wait status) reaped, not yet reported

    def report() -> None:
        while exits:
            pid, status = exits.pop(0)
            conn = running.pop(pid, None)
            if conn is None:
                continue
            if not running:  # what the last command left goes before its caller hears of its end
                exits.extend(_end_all(own_ipc))
            try:
                _send(conn, ("exit", status))
            except OSError:
                pass
            clients.pop(conn.fileno(), None)
            conn.close()

    while True:
        try:
            ready = select.select([owner_fd, wake_r, listener, *clients], [], [])[0]
        except InterruptedError:
            continue
        if owner_fd in ready:
            os._exit(0)
        if listener in ready:
            try:
                conn = listener.accept()[0]
                conn.setblocking(True)
                clients[conn.fileno()] = conn
            except BlockingIOError:
                pass
        for fd in [fd for fd in ready if fd in clients]:
            conn = clients[fd]
            if any(c is conn for c in running.values()):  # a running command's caller: a kill, or gone
                if conn.recv(1) != _KILL:
                    del clients[fd]
                exits.extend(_end_all(own_ipc))
                continue
            reply = _start(conn)
            if isinstance(reply, int):
                running[reply] = conn
                _send(conn, ("started", reply))
            else:
                _send(conn, ("error", reply))
                del clients[fd]
                conn.close()
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            exits.extend(_reaped())
        report()


def _reaped() -> list[tuple[int, int]]:
    found = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        found.append((pid, status))


def _end_all(own_ipc: bool) -> list[tuple[int, int]]:
    """Kill every process of the namespace but init (the anchor itself), until none is
    left (a fork racing the kill is caught by the next round), and clear the IPC objects
    and ``/dev/shm`` files they made. Returns what it reaped."""
    reaped = []
    while True:
        reaped += _reaped()
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # nothing but init (zombies were reaped above)
            break
        select.select([], [], [], 0.001)
    if own_ipc:
        isolation.remove_ipc(None)
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return reaped
    for name in names:
        _remove("/dev/shm/" + name)
    return reaped


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for name in os.listdir(path):
                _remove(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        pass


def _start(conn: socket.socket) -> int | str:
    """Read one request and fork its command: its pid, or why it could not start."""
    fds: list[int] = []
    try:
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 2, socket.MSG_CMSG_CLOEXEC)
        if len(header) != _HEADER.size or len(fds) != 2:
            return "a malformed request"
        request = pickle.loads(_read_exactly(conn, _HEADER.unpack(header)[0]))
        return _fork(request, *fds)
    except (OSError, EOFError, pickle.UnpicklingError) as err:
        return f"{type(err).__name__}: {err}"
    finally:
        for fd in fds:
            os.close(fd)


# bash's ulimit flag and unit (bytes per unit) for each limit; the anchor cannot set another process's limits (root
# here may lack CAP_SYS_RESOURCE), so the command's own bash takes them, as hard limits, before it reads the command
_ULIMIT = {resource.RLIMIT_CPU: ("-t", 1), resource.RLIMIT_AS: ("-v", 1024), resource.RLIMIT_FSIZE: ("-f", 1024),
           resource.RLIMIT_NOFILE: ("-n", 1), resource.RLIMIT_CORE: ("-c", 1024), resource.RLIMIT_NPROC: ("-u", 1)}
# sourced by the command's bash (BASH_ENV) before the command: nothing of the command runs without its limits
LIMITS_SCRIPT = 'ulimit -HS $GLMJAX_LIMITS || exit 126\nunset BASH_ENV GLMJAX_LIMITS\n'


def _fork(request: dict, stdin: int, output: int) -> int | str:
    """Start the command (``bash -c``): its pid, or why it could not start.

    ``posix_spawn`` (a ``vfork``: nothing of the anchor is copied) with ``resetids``: the
    anchor's real ids are the sandbox's uid (``Plan.anchor``), so the child's effective ids
    become them, and its ``exec`` makes them its saved ids too: the command holds no root
    id and no capability. Its own bash then sources ``LIMITS_SCRIPT`` (the
    ``request["bash_env"]`` file), which takes the limits before the command is read."""
    flags = " ".join(f"{_ULIMIT[which][0]} {value // _ULIMIT[which][1]}" for which, value in request["rlimits"])
    env = {**request["env"], "BASH_ENV": request["bash_env"], "GLMJAX_LIMITS": flags}
    # the agent may have taken its working directory's permissions away: it starts at /
    os.chdir(request["cwd"] if os.access(request["cwd"], os.X_OK) else "/")
    actions = [(os.POSIX_SPAWN_DUP2, stdin, 0), (os.POSIX_SPAWN_DUP2, output, 1), (os.POSIX_SPAWN_DUP2, output, 2),
               (os.POSIX_SPAWN_CLOSE, stdin), (os.POSIX_SPAWN_CLOSE, output)]
    try:
        return os.posix_spawn(request["argv"][0], request["argv"], env, file_actions=actions, setsid=True,
                              resetids=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD))
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        os.chdir("/")


# ----- the caller's side ---------------------------------------------------------------------------
class Gone(OSError):
    """The anchor is not there to take the command (it was killed): nothing was started."""


def run(path: str, *, argv: list[str], env: dict, cwd: str, uid: int | None, rlimits: list, bash_env: str,
        stdin: bytes | None, wall_seconds: float, output_bytes: int):
    """Run ``argv`` (``bash -c ...``) through the anchor listening at ``path``, its limits
    taken by ``bash_env`` (a file holding ``LIMITS_SCRIPT``, as the sandbox sees it); returns (returncode,
    output bytes, killed, truncated, seconds), as ``launcher`` does for a command of its own.
    Raises OSError when the anchor cannot be reached or the command cannot start."""
    start = time.monotonic()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            conn.connect(path)
        except (ConnectionRefusedError, FileNotFoundError) as err:
            raise Gone(f"the sandbox's anchor is not listening at {path}: {err}") from None
        body = pickle.dumps({"argv": argv, "env": env, "cwd": cwd, "uid": uid, "rlimits": rlimits, "bash_env": bash_env},
                            protocol=pickle.HIGHEST_PROTOCOL)
        socket.send_fds(conn, [_HEADER.pack(len(body))], [in_r, out_w])
        conn.sendall(body)
    except OSError:
        for fd in (out_r, out_w, in_r, in_w):
            os.close(fd)
        conn.close()
        raise
    os.close(out_w)
    os.close(in_r)
    try:
        reply = _receive(conn)
        if reply[0] != "started":
            raise OSError(f"the command could not start: {reply[1]}")
        if stdin:
            try:
                os.write(in_w, stdin)
            except BrokenPipeError:
                pass
        os.close(in_w)
        in_w = None
        output, killed, truncated, status = _collect(conn, out_r, start + wall_seconds, output_bytes)
    finally:
        if in_w is not None:
            os.close(in_w)
        os.close(out_r)
        conn.close()
    if status is None:  # the anchor went away with the command: its namespace ended
        returncode = -signal.SIGKILL
    elif os.WIFSIGNALED(status):
        returncode = -os.WTERMSIG(status)
    else:
        returncode = os.WEXITSTATUS(status)
    return returncode, output, killed, truncated, time.monotonic() - start


def _collect(conn: socket.socket, fd: int, deadline: float, cap: int):
    chunks, size, killed, status, hard_stop, eof = [], 0, None, None, None, False
    os.set_blocking(fd, False)
    exited = False
    while not (exited and eof):
        now = time.monotonic()
        if killed is None and now >= deadline:
            killed, hard_stop = "timeout", now + 5.0
            conn.sendall(_KILL)
        if hard_stop is not None and now >= hard_stop:
            break
        waits = [conn] if not exited else []
        waits += [fd] if not eof else []
        timeout = 0.2 if exited else min(0.05, max(deadline - now, 0.01)) if killed is None else 0.05
        ready = select.select(waits, [], [], timeout)[0]
        if exited and not ready:  # what the command left holding the pipe: the anchor ends it, or another command runs
            break
        if fd in ready:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                data = None
            if data == b"":
                eof = True
            elif data:
                chunks.append(data[: max(cap - size, 0)])
                size += len(data)
                if size > cap and killed is None:
                    killed, hard_stop = "output_limit", now + 5.0
                    conn.sendall(_KILL)
        if conn in ready:
            try:
                reply = _receive(conn)
            except (OSError, EOFError):
                reply = ("exit", None)
            status, exited = reply[1], True
    return b"".join(chunks), killed, size > cap, status


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the connection closed mid-message")
        data += chunk
    return data


def _send(conn: socket.socket, message) -> None:
    blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(_HEADER.pack(len(blob)) + blob)


def _receive(conn: socket.socket):
    return pickle.loads(_read_exactly(conn, _HEADER.unpack(_read_exactly(conn, _HEADER.size))[0]))
