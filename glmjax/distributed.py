"""Multi-host runs through JAX's own distributed runtime.

Every process calls `initialize` once, before anything touches a device, then builds the
same mesh over `jax.devices()` (all processes' devices) and runs the same program:

    glmjax.distributed.initialize("10.0.0.1:1234", num_processes=16, process_id=rank)
    mesh = glmjax.make_mesh(fsdp=16, expert=8, tensor=4)

On TPU pods and GPU clusters with a scheduler (SLURM, GKE, Cloud TPU), the arguments can
be omitted: jax.distributed detects them. On CPUs, collectives go through gloo.
"""

from __future__ import annotations

import jax
import numpy as np


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None) -> None:
    if jax.config.jax_platforms in ("cpu",) or (jax.config.jax_platforms or "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)


def global_array(host_data: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from data every process holds in full (e.g. a seeded batch): each
    process places only the shards its devices own."""
    return jax.make_array_from_callback(host_data.shape, sharding, lambda index: host_data[index])
