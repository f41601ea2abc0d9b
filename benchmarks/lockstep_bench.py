"""What stepping one engine from two processes costs: the same requests on one engine over
8 CPU devices, driven by one process (a Driver) or by two processes of 4 devices each in
lockstep (rl/engine/lockstep.py: every step first exchanges the requests each process made),
beside an engine per process on its own 4 devices (no program spans the processes).

    python benchmarks/lockstep_bench.py --out results/lockstep_bench.json

Model: configs/tiny.py's, on fsdp=4 x expert=2 in the decode rules (sharding.DECODE_RULES),
16 slots. A run: 32 requests of 16-47 prompt tokens and 32 new tokens each, sampled
(temperature 1), half submitted by each process in the two-process arm, all to the end.
Each arm is a launch of its processes that compiles and warms up on one run, then times
`--runs` runs (wall, and CPU of the process that drives, or of process 0); the arms'
launches alternate for `--rounds` rounds, and a run whose wall time is over 1.3x its arm's
fastest while its CPU / wall is under 0.75x the arm's best was starved of the cores: it is
run again (benchmarks/floor.py: rerun_starved). Reported per arm: tokens per second
(median; all processes' tokens), CPU / wall of process 0, engine steps per run, and for
lockstep the milliseconds each step's exchange takes (distributed.gather_objects: one
allgather of 2 KB a process when the requests fit) and its share of the run. The rest of
a lockstep step is the engine's own programs, whose collectives cross processes (gloo
over loopback here, the chips' interconnect on a pod). Every arm runs on this machine's
2 cores: the two processes of the two-process arms share them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
REQUESTS, NEW_TOKENS, SLOTS = 32, 32, 16


def worker(process_id: int, num_processes: int, port: str, out: str, runs: int, span: bool) -> None:
    """One process of an arm: builds the engine (over every process's devices with `span`,
    else over its own), warms up, times `runs` runs, writes JSON."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // num_processes}"
    sys.path.insert(0, str(REPO))
    import jax

    from glmjax import distributed

    if num_processes > 1:
        distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    import numpy as np
    from flax import nnx

    import glmjax
    from glmjax import sharding
    from rl.engine.driver import Driver, Request
    from rl.engine.engine import GlmEngine
    from rl.engine.lockstep import Lockstep
    from rl.engine.weights import WeightStore

    exchange = [0.0]
    gather = distributed.gather_objects

    def timed_gather(obj):
        start = time.perf_counter()
        try:
            return gather(obj)
        finally:
            exchange[0] += time.perf_counter() - start

    distributed.gather_objects = timed_gather
    config = _tiny_config()
    mesh = glmjax.make_mesh(fsdp=4, expert=2) if span else sharding.make_mesh(
        fsdp=4 // num_processes, expert=2, devices=jax.local_devices())
    with sharding.use_mesh(mesh):
        model = glmjax.init_model(config, seed=0, mesh=mesh)
        state = nnx.state(model)
        store = WeightStore(state, shardings=sharding.param_shardings(state, mesh, sharding.DECODE_RULES))
        engine = GlmEngine(model, weights=store, max_concurrent_decodes=SLOTS, max_len=128, mesh=mesh,
                           rules=sharding.DECODE_RULES)
        rng = np.random.default_rng(0)
        requests = [Request(rng.integers(1, config.vocab_size, 16 + i).tolist(), NEW_TOKENS, temperature=1.0, seed=i)
                    for i in range(REQUESTS)]
        mine = [r for i, r in enumerate(requests) if i % num_processes == process_id]

        def run() -> dict:
            driver = Lockstep([engine]) if engine.mesh.is_multi_process else Driver(engine)
            exchange[0] = 0.0
            wall, cpu = time.perf_counter(), time.process_time()
            handles = [driver.submit(r) for r in mine]
            if isinstance(driver, Lockstep):
                while not driver.sync(done=all(h.done() for h in handles)):
                    pass
            else:
                driver.run_until_idle()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            tokens = sum(len(h.result().tokens) for h in handles)
            steps = driver.stats["steps"]
            return {"wall": wall, "cpu": cpu, "tokens": tokens, "steps": steps, "exchange_seconds": exchange[0],
                    "syncs": getattr(driver, "syncs", 0)}

        run()  # compiles every shape
        results = [run() for _ in range(runs)]
    with open(out, "w") as f:
        json.dump(results, f)


def _tiny_config():
    """configs/tiny.py's model."""
    from glmjax import presets

    return presets.model_config_from(presets.load_config(REPO / "configs" / "tiny.py"))


def launch(num_processes: int, runs: int, span: bool = True) -> list[dict]:
    """One arm: its processes, to the end; process 0's runs (its tokens, with the others')."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"p{i}.json") for i in range(num_processes)]
        logs = [open(os.path.join(tmp, f"p{i}.log"), "w") for i in range(num_processes)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), str(num_processes), port, outs[i],
                                   str(runs), str(int(span))], stdout=logs[i], stderr=subprocess.STDOUT)
                 for i in range(num_processes)]
        for p, log in zip(procs, logs):
            if p.wait(timeout=1800) != 0:
                log.close()
                raise RuntimeError(f"lockstep_bench worker failed:\n{pathlib.Path(log.name).read_text()[-3000:]}")
        parts = [json.loads(pathlib.Path(o).read_text()) for o in outs]
    runs_0 = parts[0]
    for i, r in enumerate(runs_0):
        r["tokens"] = sum(p[i]["tokens"] for p in parts)
    return runs_0


def summarise(runs: list[dict], extra: int) -> dict:
    exchange = [r["exchange_seconds"] for r in runs]
    out = {"tokens_per_s": statistics.median(r["tokens"] / r["wall"] for r in runs),
           "seconds": statistics.median(r["wall"] for r in runs),
           "cpu_over_wall": statistics.median(r["cpu"] / r["wall"] for r in runs),
           "engine_steps": statistics.median(r["steps"] for r in runs), "runs": len(runs), "reruns": extra}
    if any(r["syncs"] for r in runs):
        out.update(syncs=statistics.median(r["syncs"] for r in runs),
                   exchange_ms_per_sync=1e3 * statistics.median(r["exchange_seconds"] / r["syncs"] for r in runs),
                   exchange_fraction=statistics.median(e / r["wall"] for e, r in zip(exchange, runs)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "results" / "lockstep_bench.json"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per launch")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks import floor, results_io

    arms = {"driver_1x8": (1, True), "lockstep_2x4": (2, True), "engine_per_process_2x4": (2, False)}
    runs = {name: [] for name in arms}
    started = time.time()
    for _ in range(args.rounds):
        for name, (n, span) in arms.items():
            runs[name] += launch(n, args.runs, span)
    report = {"setup": {"model": "configs/tiny.py", "mesh": "fsdp=4 x expert=2", "rules": "decode", "slots": SLOTS,
                        "requests": REQUESTS, "new_tokens": NEW_TOKENS, "rounds": args.rounds,
                        "runs_per_launch": args.runs, "cores": os.cpu_count()}, "arms": {}}
    for name, (n, span) in arms.items():
        pairs = [(r["wall"], r["cpu"]) for r in runs[name]]
        keep = [not bad for bad in floor.starved(pairs)]
        kept, extra = [r for r, k in zip(runs[name], keep) if k], 0
        while len(kept) < len(runs[name]) and extra < 2:  # a starved run is run again, in a launch of its own
            kept += launch(n, 1, span)
            extra += 1
        report["arms"][name] = summarise(kept, extra)
    a, b = report["arms"]["driver_1x8"], report["arms"]["lockstep_2x4"]
    report["lockstep_over_driver_tokens_per_s"] = b["tokens_per_s"] / a["tokens_per_s"]
    report["per_process_over_driver_tokens_per_s"] = report["arms"]["engine_per_process_2x4"]["tokens_per_s"] / \
        a["tokens_per_s"]
    report["wall_seconds"] = time.time() - started
    results_io.write(args.out, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]), sys.argv[7] == "1")
    else:
        main()
