"""rl/engine/weights.py with the engine's shardings: publish reshards the learner's state into
them device to device (another layout on the same devices, or disjoint devices) and is
the reference swap of before when the layouts agree."""

import jax
import numpy as np
import pytest
from flax import nnx

import glmjax
from glmjax import sharding
from rl.engine.weights import WeightStore, has_shardings
from tests.engine_util import TINY


@pytest.fixture(scope="module")
def versions():
    """Two versions of the tiny model's state, on the host's default device."""
    return [nnx.state(glmjax.init_model(TINY, seed=seed)) for seed in (0, 1)]


def _on(mesh, state):
    return jax.device_put(state, sharding.param_shardings(state, mesh))


def _assert_placed(got, want_shardings, want_values):
    """`got` has exactly the target shardings and the values of `want_values`."""
    got_leaves = jax.tree.leaves(got)
    assert len(got_leaves) == len(jax.tree.leaves(want_values))
    for x, s, ref in zip(got_leaves, jax.tree.leaves(want_shardings), jax.tree.leaves(want_values)):
        assert x.sharding == s, (x.sharding, s)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(ref))


@pytest.fixture(scope="module")
def learner(versions):
    """The learner's mesh (fsdp=8) and two versions of its state on it."""
    mesh = glmjax.make_mesh(fsdp=8)
    return mesh, _on(mesh, versions[0]), _on(mesh, versions[1])


def test_publish_reshards_into_another_layout_on_the_same_devices(learner):
    mesh, state, new = learner
    target = sharding.param_shardings(state, glmjax.make_mesh(expert=4, tensor=2))
    store = WeightStore(state, shardings=target)
    _assert_placed(store.latest().state, target, state)  # version 0 is placed too
    gate = store.latest().state["layers"][1]["mlp"]["experts"]["gate"][...]
    assert gate.sharding.spec == jax.sharding.PartitionSpec("expert", None, "tensor")
    with jax.transfer_guard_device_to_host("disallow_explicit"), \
            jax.transfer_guard_host_to_device("disallow_explicit"):
        assert store.publish(new) == 1
        placed = store.latest().state
        jax.block_until_ready(placed)
    _assert_placed(placed, target, new)
    assert has_shardings(placed, target) and not has_shardings(new, target)


def test_a_store_that_donates_writes_each_copy_into_the_previous_ones_buffers(learner):
    """donate_previous: the previous copy is deleted by the publish, whose program writes
    its output into the previous copy's buffers (the devices never hold both), and the
    values are the new state's."""
    from rl.engine.weights import reshard_program

    mesh, state, new = learner
    target = sharding.param_shardings(state, glmjax.make_mesh(expert=4, tensor=2))
    store = WeightStore(state, shardings=target, donate_previous=True)
    first = store.latest().state
    assert store.publish(new) == 1
    _assert_placed(store.latest().state, target, new)
    assert all(x.is_deleted() for x in jax.tree.leaves(first))
    assert store.publish(state) == 2  # and again, into version 1's buffers
    _assert_placed(store.latest().state, target, state)
    compiled = reshard_program(state, target, donate=True).lower(state, store.latest().state).compile()
    out = compiled.memory_analysis()
    assert out.alias_size_in_bytes >= 0.99 * out.output_size_in_bytes > 0  # XLA leaves a few small arrays unaliased


def test_same_layout_publish_is_a_reference_swap(learner):
    mesh, state, new = learner
    store = WeightStore(state, shardings=sharding.param_shardings(state, mesh))
    assert store.latest().state is state
    store.publish(new)
    assert store.latest().state is new
    assert all(a is b for a, b in zip(jax.tree.leaves(store.latest().state), jax.tree.leaves(new)))


def test_publish_across_disjoint_devices(versions):
    devices = jax.devices()
    learner_mesh = glmjax.make_mesh(fsdp=4, devices=devices[:4])
    engine_mesh = glmjax.make_mesh(expert=2, tensor=2, devices=devices[4:])
    state, new = (_on(learner_mesh, v) for v in versions)
    target = sharding.param_shardings(state, engine_mesh)
    store = WeightStore(state, shardings=target)
    with jax.transfer_guard_device_to_host("disallow_explicit"), \
            jax.transfer_guard_host_to_device("disallow_explicit"):
        store.publish(new)
        jax.block_until_ready(store.latest().state)
    _assert_placed(store.latest().state, target, new)
    assert {d.id for x in jax.tree.leaves(store.latest().state) for d in x.devices()} == {4, 5, 6, 7}


def test_version_counter_with_shardings(learner):
    mesh, state, new = learner
    store = WeightStore(state, version=3, shardings=sharding.param_shardings(state, glmjax.make_mesh(tensor=8)))
    assert store.version == 3
    assert store.publish(new) == 4
    assert store.publish(state, version=9) == 9
    with pytest.raises(ValueError, match="version must increase"):
        store.publish(new, version=9)
    assert store.wait_for(9, timeout=1).version == 9


def test_shardings_that_do_not_match_the_state_are_refused(learner):
    mesh, state, _ = learner
    with pytest.raises(ValueError, match="pytree matching the state"):
        WeightStore(state, shardings={"w": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())})
