"""rl/hlo_collectives.py: what a compiled program's collectives bring each device, against
the bytes its reshard must move, computed from the shardings."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rl.hlo_collectives import _group_size, received_bytes


@pytest.mark.parametrize("attrs, devices, size", [
    ("channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}", 4, 2),
    ("channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}", 8, 2),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_3'=8] {'axis_1','axis_3'}, use_global_device_ids=true", 64, 32),
    ("channel_id=1, dimensions={0}", 8, 8),
])
def test_replica_group_sizes_in_every_form(attrs, devices, size):
    assert _group_size(attrs, devices) == size


def test_an_all_gather_brings_each_device_what_it_lacked():
    """Rows split over 8 devices, gathered whole: each device receives 7/8 of the array."""
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(np.zeros((64, 32), np.float32), NamedSharding(mesh, PartitionSpec("x")))
    text = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec())).lower(x).compile().as_text()
    got = received_bytes(text, 8)
    assert got["count"] == {"all-gather": 1}
    assert got["bytes"] == 64 * 32 * 4 * 7 / 8


def test_a_program_without_collectives_moves_nothing():
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(np.zeros((64, 32), np.float32), NamedSharding(mesh, PartitionSpec("x")))
    assert received_bytes(jax.jit(lambda a: a * 2).lower(x).compile().as_text(), 8)["bytes"] == 0
