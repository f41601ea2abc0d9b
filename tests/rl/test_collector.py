"""The collector's grouping and DAPO's dynamic sampling, on scripted rollouts whose rewards
the test chooses (no engine: each rollout is one piece of environment work, then done)."""

import dataclasses
import itertools
import time

import pytest

from rl import rollout as ro
from rl import sao
from rl.collector import Collector

G = 4  # rollouts per prompt
RIGHT, MIXED, WRONG = (1.0,) * G, (1.0, 0.0, 1.0, 0.0), (0.0,) * G


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    rewards: tuple[float, ...]  # the reward of each member of the task's group
    lengths: tuple[int, ...] = (3,) * G  # generated tokens of each member
    crash: int | None = None  # the member whose environment raises


class Scripted:
    """A rollout of `Task`: one piece of environment work (run in the collector's pool) sets
    the scripted reward, then it is done."""

    def __init__(self, task: Task, rid: int):
        self.member = rid % G
        self.task, self.length = task, task.lengths[self.member]
        self.reward: float | None = None
        self.finish_reason: str | None = None

    def next(self):
        return None if self.finish_reason else self._verify

    def _verify(self):
        time.sleep(0.002 * self.member)  # members finish out of order across polls
        if self.member == self.task.crash:
            raise RuntimeError("the sandbox crashed")
        self.reward, self.finish_reason = self.task.rewards[self.member], "stop"

    def receive(self, result):
        raise AssertionError("a scripted rollout asks the engine nothing")

    def trajectories(self, rollout_id: int, **meta) -> list[ro.Trajectory]:
        n = self.length
        return [ro.Trajectory([1, 2], [3] * n, [-0.5] * n, [0] * n, self.reward, rollout_id, **meta)]

    def close(self):
        pass


def _tasks(*kinds) -> itertools.cycle:
    return itertools.cycle([Task(f"t{i}", rewards) for i, rewards in enumerate(kinds)])


def _collect(collector: Collector, batch_size: int, version: int, seconds: float = 10.0):
    """Polls until a batch of `batch_size` rollouts is ready, failing after `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        collector.poll(version)
        batch = collector.take(batch_size)
        if batch is not None:
            return batch
        time.sleep(0.001)
    raise AssertionError(f"no batch of {batch_size} in {seconds} s: {collector.ready_rollouts()} ready, "
                         f"{collector.in_flight} in flight, dropped {dict(collector.dropped)}")


def _groups(batch) -> dict[int, list[float]]:
    groups: dict[int, list[float]] = {}
    for tr in batch:
        groups.setdefault(tr.rollout_id // G, []).append(tr.reward)
    return groups


def test_dynamic_sampling_drops_uniform_groups_and_fills_the_batch_with_others():
    admission = ro.Admission(batch_size=2 * G, eta=0, max_concurrent=2 * G)
    collector = Collector(None, admission, Scripted, _tasks(RIGHT, MIXED, WRONG, MIXED), group_size=G, workers=4,
                          dynamic_sampling=True)
    try:
        first = _collect(collector, 2 * G, version=0)
        after_first = admission.accepted, admission.dropped, admission.running
        second = _collect(collector, 2 * G, version=1)
    finally:
        collector.close()
    # prompts 0 (all right) and 2 (all wrong) are dropped; 1 and 3 fill version 0's batch
    assert _groups(first) == {1: list(MIXED), 3: list(MIXED)}
    assert after_first == (2 * G, 2 * G, 0)
    assert _groups(second) == {5: list(MIXED), 7: list(MIXED)}  # the stream goes on: 4 and 6 dropped
    assert all(sao.dapo_keep_group(rewards) for rewards in _groups(first + second).values())
    assert {tr.task_id for tr in first + second} == {"t1", "t3"}
    assert dict(collector.dropped) == {"uniform_group": 4 * G}
    assert (admission.accepted, admission.dropped, admission.running, admission.issued) == (4 * G, 4 * G, 0, 8 * G)


def test_without_dynamic_sampling_the_same_stream_keeps_uniform_groups():
    admission = ro.Admission(batch_size=2 * G, eta=0, max_concurrent=2 * G)
    collector = Collector(None, admission, Scripted, _tasks(RIGHT, MIXED, WRONG, MIXED), group_size=G, workers=4)
    try:
        first = _collect(collector, 2 * G, version=0)
        second = _collect(collector, 2 * G, version=1)
    finally:
        collector.close()
    assert sorted(tr.rollout_id for tr in first) == list(range(2 * G))
    assert _groups(first) == {0: list(RIGHT), 1: list(MIXED)}
    assert _groups(second) == {2: list(WRONG), 3: list(MIXED)}
    assert not collector.dropped
    assert (admission.accepted, admission.dropped, admission.issued) == (4 * G, 0, 4 * G)


def test_a_group_left_uniform_by_a_crashed_member_is_dropped_whole_and_counted_by_cause():
    """The crash frees one rollout's budget, the uniform rest of its group the other three,
    so a whole prompt's worth starts in its place."""
    tasks = itertools.cycle([Task("t0", (1.0, 0.0, 1.0, 1.0), crash=1), Task("t1", MIXED), Task("t2", MIXED)])
    admission = ro.Admission(batch_size=2 * G, eta=0, max_concurrent=2 * G)
    collector = Collector(None, admission, Scripted, tasks, group_size=G, workers=4, dynamic_sampling=True)
    try:
        batch = _collect(collector, 2 * G, version=0)
        collector.poll(0)  # version 0's budget is spent: nothing more starts
        in_flight = collector.in_flight
    finally:
        collector.close()
    assert _groups(batch) == {1: list(MIXED), 2: list(MIXED)} and in_flight == 0
    assert dict(collector.dropped) == {"env_error": 1, "uniform_group": G - 1}
    assert (admission.accepted, admission.dropped, admission.running) == (2 * G, G, 0)


def test_rewards_are_compared_after_scoring_so_a_shaped_reward_can_keep_a_group():
    """Four right answers, one of them long: the overlong penalty tells them apart."""
    long_right = Task("t0", RIGHT, lengths=(3, 3, 3, 18))
    admission = ro.Admission(batch_size=G, eta=0, max_concurrent=G)

    def score(task, r):
        return r.reward + sao.dapo_overlong_penalty(r.length, max_length=20, cache_length=4)

    collector = Collector(None, admission, Scripted, itertools.repeat(long_right), group_size=G, workers=4,
                          score=score, dynamic_sampling=True)
    try:
        batch = _collect(collector, G, version=0)
    finally:
        collector.close()
    assert sorted((tr.rollout_id, tr.reward, tr.raw_reward) for tr in batch) == [
        (0, 1.0, 1.0), (1, 1.0, 1.0), (2, 1.0, 1.0), (3, 0.5, 1.0)]  # (16 - 18) / 4 = -0.5
    assert not collector.dropped


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ValueError, match="group_size >= 2, got 1"):
        Collector(None, ro.Admission(4, 0, 4), Scripted, _tasks(MIXED), dynamic_sampling=True)


def test_dynamic_sampling_stops_with_an_error_when_every_group_is_uniform():
    """All right, every time: no batch can ever fill, and the collector says so instead of
    sampling for ever."""
    collector = Collector(None, ro.Admission(2 * G, eta=0, max_concurrent=2 * G), Scripted, _tasks(RIGHT, WRONG),
                          group_size=G, workers=2, dynamic_sampling=True, max_uniform_groups=5)
    try:
        with pytest.raises(RuntimeError, match=r"dropped 5 groups in a row whose rewards were all equal"):
            _collect(collector, 2 * G, version=0)
        assert collector.dropped["uniform_group"] == 5 * G
    finally:
        collector.close()
