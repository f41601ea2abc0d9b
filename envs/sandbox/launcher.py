"""Where sandboxed commands are forked: small helper processes, never the caller.

A fork copies the caller's page tables, so its cost grows with the caller's memory: from
a process holding a model and a few thousand compiled executables one fork took 70-300 ms
(about 2 ms from a small process), and a sandbox command costs up to three (the command,
the PID namespace's init, the kill sweep). A fork of a multithreaded process (JAX runs
thread pools) is also unsafe when the child runs Python before ``exec``, as a
``preexec_fn`` does. So every command, kill sweep and isolation probe runs in a helper:
a fresh single-threaded interpreter (``python -S``, the standard library and
``envs.sandbox.isolation`` only) that serves one request at a time over a pipe and forks from its
own few megabytes. Helpers are pooled: a run takes an idle one or starts one (about
20 ms), so as many commands run at once as callers ask for.

The wire format is a 4-byte length and a pickle each way; a request is
``(name, kwargs)`` for one of ``_HANDLERS``, the reply ``(ok, value or exception)``.
"""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time

from envs.sandbox import anchor, isolation

_ENVS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the envs/ package's folder
_HEADER = struct.Struct("<I")


# ----- what a helper does ---------------------------------------------------------------------
def _run(*, argv, env, plan: isolation.Plan, stdin, wall_seconds, output_bytes):
    """Start argv under plan, read its output until exit, the deadline or the output cap.
    Returns (returncode, output bytes, killed, truncated, seconds); raises OSError or
    subprocess.SubprocessError when the command cannot be started."""
    start = time.monotonic()
    errors, plan.error_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # the child's word on why it failed
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=plan, start_new_session=True,
                                close_fds=True)
    except subprocess.SubprocessError as err:
        try:
            why = os.read(errors, 4096).decode(errors="replace")
        except BlockingIOError:
            why = ""
        raise subprocess.SubprocessError(f"{err} {why}".strip()) from None
    finally:
        os.close(plan.error_fd)
        os.close(errors)
    if stdin:
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass
    output, killed, truncated = _collect(proc, start + wall_seconds, output_bytes, plan.uid, plan.pid_ns)
    return proc.returncode, output, killed, truncated, time.monotonic() - start


def _collect(proc: subprocess.Popen, deadline: float, cap: int, uid: int | None, pid_ns: bool):
    # With a PID namespace nothing outlives the command's exit (the kernel ends the
    # namespace with its init), so only kills need the sweep.
    chunks, size, killed, hard_stop = [], 0, None, None
    swept = pid_ns and uid is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if killed is None and now >= deadline:
                killed, hard_stop = "timeout", now + 5.0
                _kill(proc, uid, pid_ns)
            if hard_stop is not None and now >= hard_stop:  # the sweep did not end it: end everything
                _kill_group(proc)
                break
            exited = proc.poll() is not None
            if sel.select(timeout=0.0 if exited else min(0.05, max(deadline - now, 0.01))):
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    data = None
                if data == b"":
                    break
                if data:
                    chunks.append(data[: max(cap - size, 0)])
                    size += len(data)
                    if size > cap and killed is None:
                        killed, hard_stop = "output_limit", now + 5.0
                        _kill(proc, uid, pid_ns)
                    continue
            if exited:
                if not swept and killed is None:
                    _kill(proc, uid, pid_ns)  # background processes may still hold the pipe
                    swept = True
                if not sel.select(timeout=0.2):
                    break
    proc.stdout.close()
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
    if not swept and killed is None:
        _kill(proc, uid, pid_ns)
    return b"".join(chunks), killed, size > cap


def _kill(proc: subprocess.Popen, uid: int | None, pid_ns: bool) -> None:
    """Kill what the command started. With a PID namespace, killing the sandbox uid's
    processes ends the namespace and the waiting parent exits by itself; killing that
    parent first would orphan the namespace's init to the host's init as a zombie."""
    if uid is not None:
        isolation.kill_uids((uid,))
    if uid is None or not pid_ns:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_HANDLERS = {"run": _run, "kill_uids": isolation.kill_uids, "probe": isolation.probe, "anchor": anchor.start}


def _read_exactly(f, n: int) -> bytes | None:
    data = f.read(n)
    return data if len(data) == n else None


def _send(f, obj) -> None:
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(blob)) + blob)
    f.flush()


def serve() -> None:
    """A helper's loop: one request at a time until its stdin closes."""
    rx, tx = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the reply pipe
    while (header := _read_exactly(rx, _HEADER.size)) is not None:
        name, kwargs = pickle.loads(_read_exactly(rx, _HEADER.unpack(header)[0]))
        try:
            reply = (True, _HANDLERS[name](**kwargs))
        except Exception as err:  # returned to the caller, who raises it
            reply = (False, err)
        try:
            _send(tx, reply)
        except BrokenPipeError:  # the caller is gone (killed or closed mid-request): so is the work
            return


# ----- the caller's side ----------------------------------------------------------------------
class HelperDied(RuntimeError):
    """A helper process exited mid-request (killed from outside, or out of memory)."""


class _Helper:
    def __init__(self):
        # The packages as bare namespaces: a helper imports this file and isolation.py, never
        # the package's __init__ files and what they pull in.
        code = ("import sys, types\n"
                f"for name, path in (('envs', {_ENVS!r}), ('envs.sandbox', {_ENVS + '/sandbox'!r})):\n"
                "    sys.modules[name] = module = types.ModuleType(name)\n"
                "    module.__path__ = [path]\n"
                "from envs.sandbox.launcher import serve\n"
                "serve()")
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True, start_new_session=True)

    def call(self, name: str, kwargs: dict):
        """The reply to one request; the helper's own exception is raised here. Anything
        else that interrupts the exchange leaves ``busy`` set: the helper is then closed."""
        self.busy = True
        try:
            _send(self.proc.stdin, (name, kwargs))
            header = _read_exactly(self.proc.stdout, _HEADER.size)
            blob = header and _read_exactly(self.proc.stdout, _HEADER.unpack(header)[0])
        except OSError as err:
            raise HelperDied(f"the sandbox helper process failed: {err}") from err
        if not blob:
            raise HelperDied(f"the sandbox helper process exited (status {self.proc.poll()}) during {name!r}")
        self.busy = False
        ok, value = pickle.loads(blob)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Pool:
    """Idle helpers of this process; a fork of this process starts its own."""

    def __init__(self):
        self.lock, self.idle, self.pid = threading.Lock(), [], os.getpid()

    def call(self, name: str, **kwargs):
        with self.lock:
            if self.pid != os.getpid():  # inherited across a fork: those helpers answer the parent
                self.idle, self.pid = [], os.getpid()
            helper = self.idle.pop() if self.idle else None
        helper = helper or _Helper()
        try:
            return helper.call(name, kwargs)
        finally:
            if helper.busy:
                helper.close()
            else:
                with self.lock:
                    self.idle.append(helper)

    def close(self) -> None:
        with self.lock:
            helpers, self.idle = self.idle, []
        for helper in helpers:
            helper.close()


_POOL = _Pool()


def call(name: str, **kwargs):
    """Run request ``name`` (``run``, ``kill_uids`` or ``probe``) in a helper."""
    return _POOL.call(name, **kwargs)


def close() -> None:
    """Stop the idle helpers (more start when needed)."""
    _POOL.close()
