"""The collector: starts rollouts as admission allows, drives them, and hands out batches.

    collector = Collector(driver, admission, make_rollout, tasks, group_size=1, tau=4, workers=4)
    while training:
        collector.poll(store.version)          # start, advance, score: never blocks
        batch = collector.take(batch_size)     # complete groups in admission order, or None

Each rollout (`rl/rollout.py`) asks for a model turn, which goes to the engine's driver,
or for environment work (a command, a verifier), which runs in a pool of `workers`
threads, so the engine keeps decoding other rollouts while one waits for its sandbox.
A rollout whose environment raises is dropped ("env_error"; "env_worker_lost" where the
Ray worker holding its sandbox died: envs/workers/ray_backend.py), one whose environment work
outlives `env_timeout` seconds is abandoned ("env_timeout"), one the engine failed
("error"), whose engine group failed under it ("engine_group_failed", rl/engine/groups.py)
or that finished more than `tau` versions behind ("stale") too; `dropped`
counts each cause, and the loop goes on. A group (`group_size` rollouts of one prompt,
GRPO) goes to the learner once all its members are finished; its kept members train.
With `dynamic_sampling` (DAPO, `sao.dapo_keep_group`) a complete group whose kept
members' rewards are all equal has no advantage and is dropped too ("uniform_group"):
admission counts its rollouts as dropped, so further prompts start until the batch is
full of groups that carry a gradient. Batches are formed in admission order, not
finishing order, so a resumed run replays.

In a job of several processes each runs its own collector and engine (`shard=(index,
count)`): its tasks are every count-th of the job's stream, and its rollout ids those
that one collector of the whole job would give them, so that the gathered batch and each
rollout's sampling seed are the same whatever the number of processes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time

from envs.workers import WorkerLost
from rl import rollout as ro
from rl import sao
from rl.engine.driver import Driver, Handle, Request
from rl.engine.groups import DOWN as GROUP_DOWN
from rl.engine.lockstep import Lockstep

log = logging.getLogger(__name__)


def _env_cause(err: BaseException) -> str:
    """The drop cause of environment work that raised `err`."""
    return "env_worker_lost" if isinstance(err, WorkerLost) else "env_error"


def _stamped(work, ended: list):
    """Runs `work` and appends the time it ended (also when it raised), so that environment
    seconds stop when the work does, not when the loop next polls."""
    try:
        return work()
    finally:
        ended.append(time.time())


class Collector:
    def __init__(self, driver: Driver, admission: ro.Admission, make_rollout, tasks, *, group_size: int = 1,
                 tau: int = 4, workers: int = 4, env_timeout: float = 600.0, score=None,
                 shard: tuple[int, int] = (0, 1), dynamic_sampling: bool = False, max_uniform_groups: int = 256):
        """`make_rollout(task, rollout_id)` -> a `rl.rollout.Rollout`; `tasks`: an iterator of
        tasks (this process's share of them with `shard`); `score(task, rollout)` -> the
        reward the learner sees (default: the rollout's); shard: (this process, processes);
        dynamic_sampling: drop groups whose scored rewards are all equal (DAPO);
        max_uniform_groups such groups in a row stop the job with an error (DAPO's cap on
        generation batches): every task is solved, or failed, by every sample, and sampling
        more would go on for ever."""
        if dynamic_sampling and group_size < 2:
            raise ValueError(f"dynamic sampling drops groups whose rewards are all equal: expected group_size >= 2, "
                             f"got {group_size} (a group of one never varies)")
        self.driver, self.admission, self.make_rollout, self.tasks = driver, admission, make_rollout, tasks
        self.group, self.tau, self.env_timeout = group_size, tau, env_timeout
        self.dynamic_sampling, self.max_uniform_groups = dynamic_sampling, max_uniform_groups
        self._uniform_in_a_row = 0
        self.shard = shard
        self.score = score or (lambda task, r: r.reward)
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="glmjax-env")
        self.dropped: collections.Counter = collections.Counter()
        self.finished: list = []  # (task, rollout) of every rollout scored since the last `drain_finished`
        self.workers = workers
        self.env_seconds = 0.0  # time rollouts spent waiting on environment work, summed over rollouts
        self.rollout_seconds = 0.0  # time from start to end, summed over finished rollouts
        self._born: dict[int, float] = {}
        self._engine: dict = {}  # driver handle -> (task, rollout, rid)
        self._env: dict = {}  # future -> (task, rollout, rid, started at, [ended at])
        self._groups = collections.defaultdict(list)  # group id -> finished members (None where dropped)
        self._ready: list = []  # complete groups: lists of rollouts, each a list of trajectories

    @property
    def in_flight(self) -> int:
        return len(self._engine) + len(self._env)

    def poll(self, version: int) -> None:
        """Starts what admission allows at `version`, then advances every rollout whose
        model turn or environment work has finished."""
        while self.admission.capacity(version) >= self.group:
            task = next(self.tasks)
            for _ in range(self.group):  # a group's ids are consecutive: rid // group names it
                rid = self._rollout_id(self.admission.issued)
                self.admission.started()
                self._born[rid] = time.time()
                self._advance(task, self.make_rollout(task, rid), rid, version)
        for h in [h for h in self._engine if h.done()]:
            task, r, rid = self._engine.pop(h)
            result = h.result()
            if result.finish_reason == "error" and (result.error or "").startswith(GROUP_DOWN):
                self._drop(r, rid, "engine_group_failed")  # its engine group failed: rl/engine/groups.py
                continue
            r.receive(result)
            self._advance(task, r, rid, version)
        now = time.time()
        for f in list(self._env):
            task, r, rid, started, ended = self._env[f]
            if f.done():
                del self._env[f]
                self.env_seconds += (ended[0] if ended else now) - started  # the worker's own end
                if f.exception() is not None:
                    log.warning("environment of rollout %d (%s) failed: %r", rid, getattr(task, "id", "?"),
                                f.exception())
                    self._drop(r, rid, _env_cause(f.exception()))
                else:
                    self._advance(task, r, rid, version)
            elif now - started > self.env_timeout:
                del self._env[f]
                self.env_seconds += now - started
                f.add_done_callback(lambda _, r=r: r.close())  # the thread ends with its command's own limit
                log.warning("environment of rollout %d (%s) exceeded %.0f s: dropped", rid, getattr(task, "id", "?"),
                            self.env_timeout)
                self._drop(r, rid, "env_timeout")

    def _rollout_id(self, issued: int) -> int:
        """The job-wide id of this collector's `issued`-th rollout: its prompt is the job's
        (prompt * processes + process)-th."""
        index, count = self.shard
        prompt, member = divmod(issued, self.group)
        return (prompt * count + index) * self.group + member

    def _advance(self, task, r, rid: int, version: int) -> None:
        """Runs the rollout's state machine to its next wait: a model turn, environment
        work, or the end."""
        while True:
            try:
                work = r.next()
            except Exception as err:  # a broken environment or rollout drops its own sample
                log.warning("rollout %d (%s) failed: %r", rid, getattr(task, "id", "?"), err)
                return self._drop(r, rid, "env_error")
            if isinstance(work, Request):
                try:
                    self._engine[self.driver.submit(work)] = (task, r, rid)
                except ValueError as err:  # a request the engine cannot serve (too long)
                    log.warning("rollout %d: %s", rid, err)
                    return self._drop(r, rid, "engine_rejected")
                return
            if work is not None:
                ended: list[float] = []
                self._env[self.pool.submit(_stamped, work, ended)] = (task, r, rid, time.time(), ended)
                return
            return self._finish(task, r, rid, version)

    def _finish(self, task, r, rid: int, version: int) -> None:
        if r.reward is None:
            return self._drop(r, rid, r.finish_reason or "error")
        segments = r.trajectories(rid, task_id=task.id, difficulty=getattr(task, "difficulty", 0.0))
        reward = float(self.score(task, r))
        for tr in segments:
            tr.raw_reward, tr.reward = tr.reward, reward
        self.finished.append((task, r))
        if max(tr.staleness(version) for tr in segments) > self.tau:
            return self._drop(r, rid, "stale")
        r.close()
        self.admission.finished(True)
        self._group_member(rid, segments)

    def _drop(self, r, rid: int, cause: str) -> None:
        self.dropped[cause] += 1
        try:
            r.close()
        except Exception:  # closing a broken environment must not stop the loop either
            log.exception("closing rollout %d failed", rid)
        self.admission.finished(False)
        self._group_member(rid, None)

    def _group_member(self, rid: int, segments) -> None:
        self.rollout_seconds += time.time() - self._born.pop(rid, time.time())
        members = self._groups[rid // self.group]
        members.append(segments)
        if len(members) == self.group:
            kept = sorted((m for m in members if m is not None), key=lambda m: m[0].rollout_id)
            del self._groups[rid // self.group]
            if kept and self.dynamic_sampling and not sao.dapo_keep_group([m[0].reward for m in kept]):
                self.dropped["uniform_group"] += len(kept)
                self.admission.rejected(len(kept))  # its members finished as accepted: their budget is free again
                self._uniform_in_a_row += 1
                if self._uniform_in_a_row >= self.max_uniform_groups:
                    raise RuntimeError(
                        f"rl.dynamic_sampling dropped {self._uniform_in_a_row} groups in a row whose rewards were all "
                        f"equal (last: {[m[0].reward for m in kept]}): the policy solves or fails every task alike, "
                        "so no batch can fill; use harder or easier tasks, or set rl.dynamic_sampling=False")
            elif kept:
                self._uniform_in_a_row = 0
                self._ready.append(kept)

    def ready_rollouts(self) -> int:
        return sum(map(len, self._ready))

    def take(self, batch_size: int) -> list[ro.Trajectory] | None:
        """The next batch (whole groups, up to batch_size rollouts, in admission order), or
        None while fewer than batch_size finished rollouts wait."""
        if self.ready_rollouts() < batch_size:
            return None
        self._ready.sort(key=lambda g: g[0][0].rollout_id)
        take, n = 0, 0
        while take < len(self._ready) and n + len(self._ready[take]) <= batch_size:
            n, take = n + len(self._ready[take]), take + 1
        batch = [tr for g in self._ready[:take] for rollout in g for tr in rollout]
        self._ready = self._ready[take:]
        return batch

    def drain_finished(self) -> list:
        out, self.finished = self.finished, []
        return out

    def close(self) -> None:
        for h in self._engine:
            h.cancel()
        for _, r, _, _, _ in self._env.values():
            r.close()
        for _, r, _ in self._engine.values():
            r.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def drive(driver: Driver, rollouts, workers: int = 4, max_active: int | None = None) -> None:
    """Runs every rollout to its end from this thread (the driver not started): the engine
    steps while any model turn is queued or decoding, environment work runs in a pool. A
    rollout whose environment raises ends without a reward (`finish_reason="env_error"`, or
    "env_worker_lost" where its Ray environment worker died).
    `rollouts` may be any iterable; with `max_active`, at most that many are in flight and
    the next starts as soon as one ends. With a Lockstep driver (rl/engine/lockstep.py) every
    process calls drive with its own rollouts, and each returns once all are done."""
    waiting = {}  # driver handle or pool future -> rollout
    pending = iter(rollouts)
    active = [0]

    def end(r, pool):
        r.close()
        active[0] -= 1
        refill(pool)

    def refill(pool):
        while max_active is None or active[0] < max_active:
            r = next(pending, None)
            if r is None:
                return
            active[0] += 1
            advance(r, pool)

    def advance(r, pool):
        try:
            work = r.next()
        except Exception as err:
            log.warning("rollout failed: %r", err)
            r.finish_reason = "env_error"
            return end(r, pool)
        if isinstance(work, Request):
            waiting[driver.submit(work)] = r
        elif work is not None:
            waiting[pool.submit(work)] = r
        else:
            end(r, pool)

    lockstep = isinstance(driver, Lockstep)  # every process steps until all are done
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="glmjax-env") as pool:
        refill(pool)
        while waiting or lockstep:
            if lockstep and driver.sync(done=not waiting):
                break
            if not lockstep and driver.load:
                driver.step()
            elif not driver.load:
                futures = [k for k in waiting if not isinstance(k, Handle)]
                timeout = 0.002 if lockstep else 0.1  # the other processes wait at the next sync
                concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
            for key in [k for k in waiting if k.done()]:
                r = waiting.pop(key)
                if isinstance(key, Handle):
                    r.receive(key.result())
                elif key.exception() is not None:
                    log.warning("environment failed: %r", key.exception())
                    r.finish_reason = _env_cause(key.exception())
                    end(r, pool)
                    continue
                advance(r, pool)
