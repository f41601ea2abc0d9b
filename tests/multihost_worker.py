"""One process of the multi-host test: a sharded train step over every process's devices,
then the updated model through an HF checkpoint: saved one gathered tensor at a time
(process 0 writes) and loaded back into expert=4 x tensor=2, each process reading the
expert tensors its devices hold.

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON
(NUM_PROCESSES 1 runs the same step on this process's devices alone.)
"""

import json
import os
import sys

process_id, num_processes, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["JAX_PLATFORMS"] = "cpu"
# the suite's other XLA flags (tests/conftest.py) stay; the device count is this process's share
os.environ["XLA_FLAGS"] = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                   + [f"--xla_force_host_platform_device_count={8 // num_processes}"])
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
import glmjax  # noqa: E402
from glmjax import distributed, safetensors_io, sharding  # noqa: E402

if num_processes > 1:
    distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from tests.glmjax.test_sharding import CONFIG as FOUR_LAYERS  # noqa: E402

# a dense layer and an expert layer: the second process compiles without the compile cache
CONFIG = FOUR_LAYERS.replace(num_hidden_layers=2, index_topk_pattern="FS")

assert len(jax.devices()) == 8, jax.devices()
mesh = glmjax.make_mesh(data=2, expert=2, tensor=2)
with sharding.use_mesh(mesh):
    model = glmjax.init_model(CONFIG, seed=0, mesh=mesh)
    graphdef, state = nnx.split(model)
    params = nnx.state(model, nnx.Param)
    ids_host = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, 16)).astype(np.int32)
    spec = sharding.logical_spec(("batch", "length"), ids_host.shape, mesh=mesh)
    ids = distributed.global_array(ids_host, jax.sharding.NamedSharding(mesh, spec))
    tx = optax.adam(1e-2)
    opt = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, opt, ids):
        def loss_fn(p):
            logits = nnx.merge(graphdef, nnx.merge_state(state, p))(ids).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        grad_norm = optax.global_norm(grads)
        checksum = sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(params))
        return params, opt, loss, grad_norm, checksum, loss_fn(params)

    params, opt, loss, grad_norm, checksum, next_loss = step(params, opt, ids)

hf_dir = os.path.join(os.path.dirname(out), "hf")
glmjax.save_pretrained(nnx.merge(graphdef, nnx.merge_state(state, params)), hf_dir)
experts_read = np.zeros(CONFIG.n_routed_experts, bool)
read = safetensors_io.Reader.read


def recording_read(self, name, index):
    if ".mlp.experts." in name:
        experts_read[int(name.split(".")[5])] = True
    return read(self, name, index)


safetensors_io.Reader.read = recording_read
load_mesh = glmjax.make_mesh(expert=4, tensor=2)
with sharding.use_mesh(load_mesh):
    loaded = nnx.state(glmjax.from_pretrained(hf_dir, mesh=load_mesh), nnx.Param)
    loaded_checksum = jax.jit(lambda p: sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(p)))(loaded)
result = {k: float(v) for k, v in dict(loss=loss, grad_norm=grad_norm, checksum=checksum,
                                       next_loss=next_loss, loaded_checksum=loaded_checksum).items()}
result["process_count"] = jax.process_count()
result["experts_read"] = [np.flatnonzero(row).tolist() for row in multihost_utils.process_allgather(experts_read)]
if process_id == 0:
    with open(out, "w") as f:
        json.dump(result, f)
