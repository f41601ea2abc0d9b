"""One process of the lockstep test: a GlmEngine over fsdp=4 x expert=2 of 8 CPU devices,
which spans both processes when there are two, driven by a Lockstep driver.

    python tests/rl/engine/lockstep_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_PREFIX

Request i belongs to process i % NUM_PROCESSES; half are submitted from a thread while the
main thread syncs. Request CANCELLED is cancelled once it has tokens. Then process 0 alone
runs two requests from a thread (`serve_while`), and a batch of 16 rows is placed from
each process's own rows (glmjax.distributed.RowShare). Writes OUT_PREFIX + PROCESS_ID.
"""

import json
import os
import sys
import threading

process_id, num_processes, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                   + [f"--xla_force_host_platform_device_count={8 // num_processes}"])
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import jax  # noqa: E402

from glmjax import distributed  # noqa: E402

if num_processes > 1:
    distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import glmjax  # noqa: E402
from glmjax import sharding  # noqa: E402
from rl.engine.driver import Request  # noqa: E402
from rl.engine.engine import GlmEngine  # noqa: E402
from rl.engine.lockstep import Lockstep, driver_for  # noqa: E402
from rl.engine.weights import WeightStore  # noqa: E402
from tests.glmjax.test_sharding import CONFIG as FOUR_LAYERS  # noqa: E402

CONFIG = FOUR_LAYERS.replace(num_hidden_layers=2, index_topk_pattern="FS")
REQUESTS, CANCELLED = 8, 5

mesh = glmjax.make_mesh(fsdp=4, expert=2)
with sharding.use_mesh(mesh):
    model = glmjax.init_model(CONFIG, seed=0, mesh=mesh)
    state = nnx.state(model)
    store = WeightStore(state, shardings=sharding.param_shardings(state, mesh, sharding.DECODE_RULES))
    engine = GlmEngine(model, weights=store, max_concurrent_decodes=4, max_len=64, mesh=mesh,
                       rules=sharding.DECODE_RULES, record_routes=True)
    driver = driver_for(engine)
    assert isinstance(driver, Lockstep) == (num_processes > 1)
    if num_processes == 1:  # the reference: one process of 8 devices, the same driver
        driver = Lockstep([engine])
    rng = np.random.default_rng(0)
    requests = [Request(rng.integers(1, CONFIG.vocab_size, 3 + 2 * i).tolist(), 40 if i == CANCELLED else 6 + i,
                        temperature=1.0, seed=i, session_id=f"s{i}") for i in range(REQUESTS)]
    mine = {i: None for i in range(REQUESTS) if i % num_processes == process_id}
    first, later = list(mine)[:len(mine) // 2], list(mine)[len(mine) // 2:]
    for i in first:
        mine[i] = driver.submit(requests[i])
    if CANCELLED in mine and mine[CANCELLED] is not None:
        handle = mine[CANCELLED]
        handle.add_chunk_callback(lambda chunk, h=handle: h.cancel())

    def submit_later():
        for i in later:
            mine[i] = driver.submit(requests[i])
            if i == CANCELLED:
                mine[i].add_chunk_callback(lambda chunk, h=mine[i]: h.cancel())

    thread = threading.Thread(target=submit_later)
    thread.start()
    while not driver.sync(done=not thread.is_alive() and all(h is not None and h.done() for h in mine.values())):
        pass
    results = {i: h.result() for i, h in mine.items()}

    # work that blocks on one process: its thread waits on handles while every main thread syncs
    def on_process_0():
        handles = [driver.submit(Request([3, 4, 5], 5, seed=100 + k)) for k in range(2)]
        return [h.result(timeout=120).tokens for h in handles]

    served = driver.serve_while(on_process_0 if process_id == 0 else lambda: None)

    share = distributed.RowShare.of(mesh, 16)
    data = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    placed = share.place(data[share.rows], mesh)
    weighted = float(jax.jit(lambda x: (x * np.arange(1, 17, dtype=np.float32)[:, None]).sum())(placed))

# values longer than the inline part on one process only, and short ones
gathered = [len(x) for x in distributed.gather_objects(list(range(1000 * (process_id + 1))))]
gathered += distributed.gather_objects(process_id)

report = {"gathered": gathered, "results": {i: {"tokens": r.tokens, "log_probs": r.log_probs, "finish_reason": r.finish_reason,
                          "routes": None if r.routes is None else r.routes.tolist()} for i, r in results.items()},
          "served": served, "rows": share.rows.tolist(), "disjoint": share.disjoint, "weighted": weighted,
          "syncs": driver.syncs, "in_flight": len(driver._mirrors)}
with open(out + str(process_id), "w") as f:
    json.dump(report, f)
print("done", process_id, flush=True)
