"""Engine groups in the RL job (rl/engine/groups.py): two engines over blocks of the
learner's 8 devices behind one router, each publish one XLA program that gives every
device its own shards; a group whose driver is killed mid-run loses its rollouts in
flight, counted, is rebuilt, and the run completes."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import glmjax
from glmjax import sharding
from rl.engine.groups import EngineGroups, group_meshes
from rl.hlo_collectives import received_bytes
from rl.engine.weights import groups_publish_hlo
from tests.engine_util import TINY
from tests.rl.test_trainer import REPO, _cmd, _env

GROUPS = ["--config.mesh.fsdp=8", "--config.rl.engine_groups=2", "--config.rl.engine_mesh=expert=2,tensor=2",
          "--config.rl.engine_rules=decode", "--config.rl.steps=4", "--config.rl.batch_size=16",
          "--config.rl.slots=8"]

# One group's driver is stopped once it holds rollouts (after the first publish), as a crashed
# host would leave it; the watchdog must notice, drop those rollouts and rebuild the group.
KILLED_GROUP = """
import sys, threading, time
from rl import cli, trainer

build = trainer._engine_groups

def killing(*args, **kw):
    groups = build(*args, **kw)
    def kill():
        while groups.store.version < 1 or not groups.drivers[1].active:
            time.sleep(0.005)
        groups.drivers[1].stop()
        print(f"killed group 1 holding {groups.drivers[1].active} requests", flush=True)
    threading.Thread(target=kill, daemon=True).start()
    return groups

trainer._engine_groups = killing
cli.main(sys.argv[1:])
"""


# Two processes: group 1's step raises on both (as a program's error does) once it holds rollouts
FAILING_GROUP = """
import sys
from rl import cli, trainer

build = trainer._engine_groups

def failing(*args, **kw):
    groups = build(*args, **kw)
    driver, failed = groups.drivers[1], []
    step = driver.step
    def once():
        if not failed and groups.store.version >= 1 and driver.active:
            failed.append(driver.active)
            print(f"group 1 fails holding {driver.active} requests", flush=True)
            raise RuntimeError("injected failure of engine group 1")
        return step()
    driver.step = once
    return groups

trainer._engine_groups = failing
cli.main(sys.argv[1:])
"""


def test_group_meshes_interleave_along_the_first_engine_axis():
    mesh = glmjax.make_mesh(fsdp=8)
    meshes = group_meshes(mesh, 2, {"expert": 2, "tensor": 2})
    assert [[d.id for d in m.devices.flat] for m in meshes] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="must cover the learner's 8 devices"):
        group_meshes(mesh, 3, {"expert": 2, "tensor": 2})


def test_publishing_gives_every_group_the_learners_weights_and_each_device_about_its_share():
    """Every group's engine state equals the learner's, in the group's own layout; the
    publish program's collectives bring each device at most 1.1x its share of the engine's
    parameters (the figure benchmarks/sharding_bench.py reports for configs/small.py)."""
    mesh = glmjax.make_mesh(fsdp=8)
    policy = glmjax.init_model(TINY, seed=0, mesh=mesh)
    groups = EngineGroups.build(policy, mesh, 2, {"expert": 2, "tensor": 2}, sharding.DECODE_RULES,
                                max_concurrent_decodes=4, max_len=64)
    new = jax.tree.map(lambda x: x + 1, nnx.state(policy))
    groups.store.publish(new)
    want = jax.tree.map(np.asarray, new)
    for engine, store in zip(groups.engines, groups.store.stores):
        state = store.latest().state
        assert store.version == 1
        for got, expected, target in zip(jax.tree.leaves(state), jax.tree.leaves(want),
                                         jax.tree.leaves(engine.param_shardings)):
            assert got.sharding == target
            np.testing.assert_array_equal(np.asarray(got), expected)
    shardings = [s.shardings for s in groups.store.stores]
    moved = received_bytes(groups_publish_hlo(new, shardings), mesh.size)["bytes"]
    share = max(sum(s.data.nbytes for x in jax.tree.leaves(groups.store.stores[0].latest().state)
                    for s in x.addressable_shards if s.device == d) for d in groups.engines[0].mesh.devices.flat)
    assert moved <= 1.1 * share, (moved, share)


def test_a_killed_group_drops_only_its_rollouts_and_the_run_completes(tmp_path):
    done = subprocess.run([sys.executable, "-c", KILLED_GROUP, *_cmd(tmp_path, *GROUPS)[3:]], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 engine groups of expert=2, tensor=2 (devices 0,1,4,5 | 2,3,6,7)" in done.stdout
    killed = int(done.stdout.split("killed group 1 holding ")[1].split()[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    groups = summary["engine_groups"]
    assert summary["steps"] == 4 and summary["rollouts"] == 64
    assert groups["failures"] == {"stopped": 1}
    assert 1 <= groups["dropped_in_flight"] == summary["dropped"]["engine_group_failed"] <= killed + 8
    assert sum(summary["dropped"].values()) == groups["dropped_in_flight"]  # nothing else was lost
    assert all(n > 0 for n in groups["requests"]) and all(u > 0 for u in groups["slot_utilisation"])


def test_a_stalled_group_is_rebuilt_and_the_others_serve_on():
    """Group 1's third decode step hangs (a device that stopped answering): after
    stall_seconds its requests end as UNAVAILABLE, a new driver takes its place, and every later request
    is served, by either group."""
    import threading

    from rl.engine.driver import Request
    from rl.engine.groups import DOWN

    mesh = glmjax.make_mesh(fsdp=8)
    policy = glmjax.init_model(TINY, seed=0, mesh=mesh)
    groups = EngineGroups.build(policy, mesh, 2, {"expert": 2, "tensor": 2}, sharding.DECODE_RULES,
                                stall_seconds=0.5, max_concurrent_decodes=4, max_len=64)
    groups.check_seconds = 0.05
    hung, release, steps = groups.drivers[1], threading.Event(), []
    step = hung.step

    def hanging():  # after two steps (a group's first may be compiling), a step that never returns
        steps.append(1)
        if len(steps) > 2:
            release.wait()
        return step()

    hung.step = hanging
    groups.start()
    try:
        first = [groups.submit(Request([1, 2, 3, 4 + i], 8, seed=i)) for i in range(4)]
        results = [h.result(timeout=120) for h in first]
        failed = [r for r in results if r.finish_reason == "error"]
        assert failed and all(r.error.startswith(f"{DOWN} 1 stalled") for r in failed), [r.error for r in failed]
        assert all(len(r.tokens) == 8 for r in results if r.finish_reason != "error")
        assert groups.failures == {"stalled": 1} and groups.dropped_in_flight == len(failed)
        later = [groups.submit(Request([5, 6, 7, i], 8, seed=10 + i)) for i in range(8)]
        assert all(len(h.result(timeout=120).tokens) == 8 for h in later)
    finally:
        release.set()
        groups.stop()


def test_two_processes_step_two_groups_that_span_both_and_a_failed_group_drops_only_its_rollouts(tmp_path):
    """2 processes of 4 devices, 2 engine groups of 4 devices, each group over devices of
    both processes (stepped in lockstep, rl/engine/lockstep.py): both groups take requests
    and keep slots busy; group 1's step fails once it holds rollouts, those rollouts are
    dropped and counted on every process alike, the group is rebuilt, and the run completes."""
    from tests.glmjax.test_multihost import _job

    first, _ = _job(tmp_path, 2, "--config.rl.engine_groups=2", "--config.rl.engine_mesh=expert=2,tensor=2",
                    "--config.rl.engine_rules=decode", "--config.rl.steps=4", "--config.rl.batch_size=16",
                    "--config.rl.slots=8", code=FAILING_GROUP)
    # a process's CPU devices are numbered from 2048 x its index: each group holds two of each process's
    assert ("over 2 processes; 2 engine groups of expert=2, tensor=2 (devices 0,1,2048,2049 | 2,3,2050,2051), "
            "every process stepping them in lockstep") in first.stdout, first.stdout[-2000:]
    held = int(first.stdout.split("group 1 fails holding ")[1].split()[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    groups = summary["engine_groups"]
    assert summary["processes"] == 2 and summary["steps"] == 4 and summary["rollouts"] == 64
    assert groups["failures"] == {"error": 1}
    assert held <= groups["dropped_in_flight"] == summary["dropped"]["engine_group_failed"] <= held + 8
    assert sum(summary["dropped"].values()) == groups["dropped_in_flight"]  # nothing else was lost
    assert all(n > 0 for n in groups["requests"]) and all(u > 0 for u in groups["slot_utilisation"])
