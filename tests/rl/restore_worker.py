"""One process of the coordinated-restore test: two processes of 2 CPU devices save loop
checkpoints of a policy sharded over all 4 devices, then process 1 alone truncates its own
shard file of the newest step and both restore.

    python tests/rl/restore_worker.py PROCESS_ID PORT WORKDIR
Writes WORKDIR/restored_<PROCESS_ID>.json: the step restored and this process's shards.
"""

import json
import os
import pathlib
import sys

process_id, port, workdir = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                   + ["--xla_force_host_platform_device_count=2"])
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from glmjax import distributed  # noqa: E402

distributed.initialize(f"127.0.0.1:{port}", 2, process_id)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from rl.checkpoint import LoopCheckpointer  # noqa: E402
from tests.rl.test_checkpoint import _loop  # noqa: E402

mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices())


def sharded(value: float) -> dict:
    """`_loop(value)` as global arrays: 2-D ones split by rows over both processes' devices,
    the others replicated."""
    loop = _loop(value)

    def place(x):
        return distributed.global_array(np.asarray(x), NamedSharding(mesh, PartitionSpec(*["fsdp"][:np.ndim(x) - 1])))

    for module in (loop["policy"], loop["learner"].actor_opt):
        nnx.update(module, jax.tree.map(place, nnx.state(module)))
    return loop


directory = workdir / "checkpoints"
ckpt = LoopCheckpointer(str(directory))
for step in (1, 2):
    ckpt.save(step, **sharded(step), version=step)
ckpt.wait()
distributed.gather_objects("saved")
if process_id == 1:  # this host's own shards of step 2 no longer read; process 0's do
    mine = directory / "2" / "arrays" / "ocdbt.process_1" / "d"
    largest = max(mine.iterdir(), key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
distributed.gather_objects("truncated")

loop = sharded(0.0)
meta = LoopCheckpointer(str(directory)).restore(**loop)
kernel = loop["policy"].kernel[...]
shards = {str(s.index): float(np.asarray(s.data).mean()) for s in kernel.addressable_shards}
(workdir / f"restored_{process_id}.json").write_text(json.dumps({"step": meta["step"], "shards": shards}))
