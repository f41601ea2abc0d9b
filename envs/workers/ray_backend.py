"""Environment workers on Ray: each episode's ``ShellEnv`` lives in one of a pool of Ray
actors, on this machine or across a cluster's nodes.

    workers = RayWorkers(4, address="")         # "": a private Ray on this machine
    env = workers.env(max_turns=4, timing=False)  # ShellEnv's interface
    obs = env.reset(task)                        # the sandbox is made on the least-loaded live worker
    obs, reward, done, info = env.step("<bash>cat kv</bash>")   # ... and every call runs there
    env.close()
    workers.close()

How it works:
1. ``RayWorkers`` connects to Ray (``address``: "" starts a private Ray on this machine,
   bound to loopback; "auto" attaches to the one ``ray start`` runs here; "host:port" to a
   cluster's head) and starts ``count`` worker actors spread over the nodes, each
   reserving ``cpus`` of its node's CPUs and running up to ``slots`` environment calls at
   once (threads of the actor; the rest queue on it).
2. ``env(**shell_args)`` gives a ``RemoteEnv``: at ``reset`` it picks the live worker with
   the fewest open episodes, and the worker makes the episode's ``ShellEnv`` (sandbox and
   all); ``step``, ``act`` and ``finish`` go to that worker; ``close`` frees the sandbox
   there without waiting. One sandbox per episode, pinned to its worker.
3. A task travels by value: a ``HarborTask`` holds its files, tests and solution as
   contents, so a node needs no disk shared with the trainer. Its image's layer (a
   directory of the trainer's image cache, named by the hash of what built it) is used in
   place where the worker's node has that directory; else the worker asks for it, and the
   pool sends it once (a tar of it, overlay's whiteouts and opaque directories kept, put
   in Ray's object store) to be unpacked under ``LAYERS`` on that node. (Its ``source``,
   the directory it was read from, is only hidden from the agent where it exists.)
4. A worker whose process dies loses its episodes' sandboxes: every call of those episodes
   raises ``WorkerLost`` (the collector drops them as "env_worker_lost"), and a fresh
   actor takes the dead one's place for new episodes. An error inside the environment
   (``UnsupportedTask``, a call before ``reset``) is raised as the environment raised it.

Each node runs the trainer's installation (glmjax and what its sandboxes need); Ray is
imported only here, when a pool starts, so nothing else needs it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import hashlib
import ipaddress
import itertools
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from typing import Any

from envs.base import Step, Transcript

log = logging.getLogger(__name__)

# Ray rewrites 127.0.0.1 and "localhost" to the machine's interface address
# (ray._private.services.resolve_ip_for_localhost) and keeps any other address of 127/8,
# which the kernel routes over the loopback device: a Ray of this machine only is told this one.
LOOPBACK = "127.0.0.2"
START_SECONDS = 120.0  # a worker not running by then (no node with its CPUs free) is an error
CLOSE_SECONDS = 10.0  # for the open episodes' sandboxes to be removed when the pool closes
LAYERS = os.path.join(os.path.expanduser("~"), ".cache", "glmjax", "layers")  # image layers sent to this node
_TAR = ("--xattrs", "--xattrs-include=*", "--numeric-owner")  # overlay marks deletions with devices and xattrs


class WorkerLost(RuntimeError):
    """The worker that held this episode's sandbox died: the episode cannot go on."""


def pack_layer(path: str) -> bytes:
    """The image layer at ``path`` as a tar (module docstring)."""
    done = subprocess.run(["tar", "--create", *_TAR, "-C", path, "."], capture_output=True)
    if done.returncode:
        raise OSError(f"cannot pack the image layer {path}: tar: {done.stderr.decode(errors='replace')[-500:]}")
    return done.stdout


def unpack_layer(data: bytes, dest: str) -> None:
    """A tar of ``pack_layer`` into ``dest``, which appears whole or not at all."""
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".unpacking-", dir=parent)
    try:
        done = subprocess.run(["tar", "--extract", *_TAR, "-C", staging], input=data, capture_output=True)
        if done.returncode:
            raise OSError(f"cannot unpack an image layer into {dest}: tar: "
                          f"{done.stderr.decode(errors='replace')[-500:]}")
        os.rename(staging, dest)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.isdir(dest):  # else another worker of this node unpacked it first
            raise


class Worker:
    """The actor: the open episodes' ShellEnvs by key. Ray runs its methods in ``slots``
    threads, so one episode's command does not hold up another's."""

    def __init__(self):
        self.envs: dict[int, Any] = {}
        self._unpacking = threading.Lock()

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def reset(self, key: int, shell_args: dict, task, layer: bytes | None = None) -> tuple[str, tuple[str, int]] | None:
        """The episode's first observation, and where it runs; None when this node lacks
        the task's image layer and ``layer`` (``pack_layer``'s tar of it) is needed."""
        from envs.shell import ShellEnv

        task = self.local(task, layer)
        if task is None:
            return None
        env = ShellEnv(**shell_args)
        observation = env.reset(task)  # raises (UnsupportedTask) before the env is kept
        self.envs[key] = env
        return observation, self.where()

    def local(self, task, layer: bytes | None):
        """``task`` with its image layer where this node has it: the trainer's own path, or
        the copy sent here (unpacked from ``layer`` if it is not yet); None if one is needed."""
        path = getattr(task, "layer", None)
        if not path or os.path.isdir(path):
            return task
        copy = os.path.join(LAYERS, hashlib.sha256(path.encode()).hexdigest()[:32])
        if not os.path.isdir(copy):
            if layer is None:
                return None
            with self._unpacking:
                if not os.path.isdir(copy):
                    unpack_layer(layer, copy)
        return task.replace(layer=copy)

    def call(self, key: int, method: str, args: tuple) -> tuple[Any, Transcript | None]:
        """The env's ``method(*args)``, and its transcript once the episode has ended."""
        env = self.envs.get(key)
        if env is None:
            raise RuntimeError(f"ShellEnv.{method} on a closed episode (or before reset)")
        out = getattr(env, method)(*args)
        return out, env.transcript if env.task is None else None

    def transcript(self, key: int) -> Transcript | None:
        env = self.envs.get(key)
        return env.transcript if env is not None else None

    def close(self, key: int) -> None:
        env = self.envs.pop(key, None)
        if env is not None:
            env.close()

    def close_all(self) -> None:
        for key in list(self.envs):
            self.close(key)


@dataclasses.dataclass(eq=False)
class _Slot:
    """One worker as the pool sees it: its actor and how many episodes are pinned to it."""

    actor: Any
    episodes: int = 0
    node: str | None = None
    pid: int | None = None


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def connect(address: str = "") -> bool:
    """Connects this process to Ray at ``address`` (module docstring) unless it already is;
    True if this call started the connection (its owner shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the job reports nothing to Ray's servers
    args = dict(include_dashboard=False, logging_level=logging.WARNING)
    if not address:
        # Ray turns token authentication on for a cluster it starts; a token of its own, in
        # the environment its processes inherit, keeps Ray from writing a shared one to ~/.ray
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        args.update(address="local", _node_ip_address=LOOPBACK)
    elif address != "auto" and _loopback(address):  # a cluster bound to loopback: this process joins as such
        host = address.rpartition(":")[0].strip("[]")
        args.update(address=address, _node_ip_address=LOOPBACK if host in ("localhost", "127.0.0.1") else host)
    else:
        args.update(address=address)
    if threading.current_thread() is threading.main_thread():
        ray.init(**args)
        return True
    # The processes of a Ray started here die with the thread that starts them (Ray sets
    # PR_SET_PDEATHSIG, which follows the thread), and the first episode's reset comes from
    # one of the environment threads: a thread that lasts as long as the process starts it.
    started: concurrent.futures.Future = concurrent.futures.Future()

    def init_and_stay():
        try:
            ray.init(**args)
        except BaseException as err:
            started.set_exception(err)
            return
        started.set_result(True)
        threading.Event().wait()

    threading.Thread(target=init_and_stay, name="glmjax-ray", daemon=True).start()
    return started.result()


class RayWorkers:
    """``count`` environment workers (module docstring); ``cpus``: what each reserves of
    its node's CPUs; ``slots``: environment calls each runs at once."""

    def __init__(self, count: int, *, address: str = "", cpus: float = 1.0, slots: int = 8):
        import ray

        if count < 1 or slots < 1 or cpus < 0:
            raise ValueError(f"RayWorkers needs count >= 1, slots >= 1 and cpus >= 0: got count={count}, "
                             f"slots={slots}, cpus={cpus}")
        self.count, self.address, self.cpus, self.slots = count, address, cpus, slots
        self._owns_ray = connect(address)
        self._actor = ray.remote(Worker).options(num_cpus=cpus, max_concurrency=slots, max_restarts=0,
                                                  scheduling_strategy="SPREAD")
        self._lock = threading.Lock()
        self._keys, self._turns = itertools.count(), itertools.count()
        self.lost = 0  # workers that died and were replaced
        self._layers: dict[str, Any] = {}  # image layer path -> its tar in Ray's object store
        self._packing = threading.Lock()
        self._live = [_Slot(self._actor.remote()) for _ in range(count)]
        self._await_start(self._live)
        atexit.register(self.close)  # runs before Ray's own exit handler ends the workers as they are

    def _await_start(self, slots: list[_Slot]) -> None:
        import ray

        pending = {s.actor.where.remote(): s for s in slots}
        ready, waiting = ray.wait(list(pending), num_returns=len(pending), timeout=START_SECONDS)
        for ref in ready:
            pending[ref].node, pending[ref].pid = ray.get(ref)
        if waiting:
            self.close()
            raise RuntimeError(
                f"{len(waiting)} of {len(slots)} Ray environment workers (env.ray_worker_cpus={self.cpus} CPUs each) "
                f"did not start in {START_SECONDS:.0f} s at address {self.address or 'local'!r}: the cluster has "
                f"{ray.available_resources().get('CPU', 0)} of {ray.cluster_resources().get('CPU', 0)} CPUs free; "
                "lower env.ray_workers or env.ray_worker_cpus, or add nodes")

    def env(self, **shell_args) -> RemoteEnv:
        """An environment with ``ShellEnv``'s interface (``shell_args``: its constructor's)."""
        return RemoteEnv(self, shell_args)

    def workers(self) -> list[dict]:
        """Each live worker: its node id, process id and open episodes."""
        with self._lock:
            return [{"node": s.node, "pid": s.pid, "episodes": s.episodes} for s in self._live]

    def _checkout(self, tried: set) -> _Slot:
        with self._lock:
            start = next(self._turns) % len(self._live)  # ties go round the workers, not to the first
            free = [s for s in self._live[start:] + self._live[:start] if s not in tried]
            if not free:
                raise WorkerLost(f"every Ray environment worker died while an episode was starting ({self.lost} lost)")
            slot = min(free, key=lambda s: s.episodes)
            slot.episodes += 1
            return slot

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.episodes -= 1

    def _lost(self, slot: _Slot, err: Exception) -> None:
        """``slot``'s actor died: a fresh one takes its place (not awaited: calls queue on it
        until it runs; its node and pid are known from its first episode)."""
        with self._lock:
            if slot not in self._live:
                return  # replaced already, by another of its episodes
            self.lost += 1
            log.warning("Ray environment worker %s on node %s died (%s): %d episode(s) lost; starting a new one",
                        slot.pid, slot.node, type(err).__name__, slot.episodes)
            self._live[self._live.index(slot)] = _Slot(self._actor.remote())

    def alive(self, slot: _Slot) -> bool:
        return slot in self._live

    def _layer(self, path: str):
        """The image layer at ``path``, packed and put in Ray's object store once."""
        import ray

        with self._packing:
            if path not in self._layers:
                self._layers[path] = ray.put(pack_layer(path))
            return self._layers[path]

    def close(self) -> None:
        """Closes the open episodes' sandboxes (for up to ``CLOSE_SECONDS``), then ends the
        workers, and the Ray this pool started."""
        import ray

        if self._live and ray.is_initialized():
            closing = [s.actor.close_all.remote() for s in self._live]
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_SECONDS)
            for s in self._live:
                ray.kill(s.actor)
        self._live = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


class RemoteEnv:
    """``ShellEnv``'s interface (reset, step, act, finish, close, transcript) over one
    episode's worker: made by ``RayWorkers.env``."""

    def __init__(self, pool: RayWorkers, shell_args: dict):
        self.pool, self.shell_args = pool, shell_args
        self._slot: _Slot | None = None
        self._key: int | None = None
        self._transcript: Transcript | None = None
        self.where: dict | None = None  # the node id and pid of the last episode's worker

    def reset(self, task) -> str:
        import ray

        self.close()
        tried: set = set()
        while True:  # a worker found dead here costs the episode nothing yet: the next one takes it
            slot = self.pool._checkout(tried)
            key = next(self.pool._keys)
            try:
                reply = self._get(slot.actor.reset.remote(key, self.shell_args, task))
                if reply is None:  # the worker's node lacks the task's image layer: it gets a copy
                    layer = self.pool._layer(task.layer)
                    reply = self._get(slot.actor.reset.remote(key, self.shell_args, task, layer))
                observation, (slot.node, slot.pid) = reply
            except ray.exceptions.RayActorError as err:
                self.pool._release(slot)
                self.pool._lost(slot, err)
                tried.add(slot)
                continue
            except BaseException:
                self.pool._release(slot)
                raise
            self._slot, self._key, self._transcript = slot, key, None
            self.where = {"node": slot.node, "pid": slot.pid}
            return observation

    def step(self, action: str) -> Step:
        return self._call("step", action)

    def act(self, parsed, text: str | None = None) -> Step:
        return self._call("act", parsed, text)

    def finish(self) -> Step:
        return self._call("finish")

    @property
    def transcript(self) -> Transcript | None:
        """The episode so far (asked of its worker), or the last episode's once it ended."""
        if self._slot is None or self._transcript is not None:
            return self._transcript
        return self._remote(lambda a: a.transcript.remote(self._key))

    def close(self) -> None:
        """Frees the episode's sandbox on its worker, without waiting for it."""
        slot, self._slot = self._slot, None
        if slot is not None:
            self.pool._release(slot)
            if self.pool.alive(slot):  # a dead worker's sandboxes went with it
                slot.actor.close.remote(self._key)

    def _call(self, method: str, *args):
        if self._slot is None:
            raise RuntimeError(f"ShellEnv.{method} before reset (or after the episode ended)")
        out, transcript = self._remote(lambda a: a.call.remote(self._key, method, args))
        if transcript is not None:
            self._transcript = transcript
        return out

    def _remote(self, send):
        import ray

        slot = self._slot
        try:
            return self._get(send(slot.actor))
        except ray.exceptions.RayActorError as err:
            self.pool._lost(slot, err)
            raise WorkerLost(f"the Ray environment worker of this episode (pid {slot.pid} on node {slot.node}) "
                             f"died: {type(err).__name__}") from err

    @staticmethod
    def _get(ref):
        """The call's result; an error inside the environment is raised as it was raised there."""
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            raise err.cause from err
