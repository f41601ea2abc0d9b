"""Train-step time of configs/small.py across meshes on 8 fake CPU devices, the share
of it spent in the MoE dispatch, and the time to publish weights between layouts.

    python benchmarks/sharding_bench.py --out results/sharding_bench.json
    python benchmarks/sharding_bench.py --out /tmp/publish.json --parts publish
    python benchmarks/sharding_bench.py --out results/sharding_bench.json --parts publish --update

The 8 devices share this machine's cores, so absolute times say little; the ratios
between meshes show the cost of each layout's collectives. The MoE share is measured
inside the step itself: the share of its XLA op time (from a profiler trace of one step)
spent in the instructions under the MoE layers' named scope "moe" (routing, exchange,
grouped matmuls, forward and backward); `moe_s` is that share of the step's time.

rl: one synchronous SAO step of the tiny model (configs/tiny.py) under several meshes (and
one with the engine on devices of its own, as `rl.engine_mesh` puts it):
RL_BATCH prompts generated to RL_NEW tokens through the engine on the mesh, the learner's
critic phase and actor step on the batch as global arrays, and the publish into the
engine's layout; seconds of each part, median of the repeats, the arms interleaved
repeat by repeat with each arm's CPU time over its wall time.

load: host memory of `glmjax.from_pretrained(path, mesh=...)` for configs/small.py on 4
devices, in a fresh process: the peak above what the loaded arrays themselves hold (on
CPU the devices' memory is the host's, so the arrays count in full), against the
checkpoint's size; twice: the whole resident set, which includes the checkpoint's
memory-mapped file pages that reading a slice touches (page cache, given back under
pressure), and its anonymous part alone (memory the load allocates), sampled every 2 ms.
Each shard is read and placed alone, so the anonymous excess stays near the largest
shard, not the model.

publish: milliseconds of `WeightStore.publish` (rl/engine/weights.py) for configs/tiny.py and
configs/small.py, until the published arrays are ready, median of PUBLISH_REPEATS: into
the learner's own layout (fsdp=8, a reference swap), into another layout on the same
devices (expert=4 x tensor=2) and onto disjoint devices (fsdp=4 on devices 0-3 to
expert=2 x tensor=2 on 4-7).

publish_groups: the same models from the learner's fsdp=8 into 2 engine groups of expert=2
x tensor=2 in the serving rules (rl/engine/groups.py, as `rl.engine_groups=2` builds them):
milliseconds per publish (median of PUBLISH_REPEATS), and the bytes its one program's
collectives bring each device (rl/hlo_collectives.py, from the compiled HLO) beside the
largest share of the engine's parameters a device holds; `bytes_over_share` is their
ratio. For comparison, the same figures for XLA's direct reshard into the same layout on
the same devices (one engine of expert=4 x tensor=2: `reshard_same_devices`).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import glmjax  # noqa: E402
from glmjax import presets, sharding  # noqa: E402
from rl import sao  # noqa: E402
from rl.config import RLConfig  # noqa: E402
from rl.engine.driver import Driver, Request  # noqa: E402
from rl.engine.engine import GlmEngine  # noqa: E402
from rl.engine.groups import EngineGroups  # noqa: E402
from rl.engine.weights import WeightStore, groups_publish_hlo  # noqa: E402
from rl.hlo_collectives import received_bytes  # noqa: E402
from rl.learner import Learner, ValueModel  # noqa: E402

MESHES = {
    "data8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "expert8": dict(expert=8),
    "data2-expert2-tensor2": dict(data=2, expert=2, tensor=2),
    "fsdp4-expert2": dict(fsdp=4, expert=2),
    "sequence4-tensor2": dict(sequence=4, tensor=2),
    "tensor8": dict(tensor=8),
}
# (learner mesh, engine rules): None = one device; "decode" = sharding.DECODE_RULES
RL_MESHES = {
    "one_device": (None, None),
    "fsdp8": (dict(fsdp=8), None),
    "fsdp4-expert2": (dict(fsdp=4, expert=2), None),
    "fsdp4-expert2_engine_decode": (dict(fsdp=4, expert=2), "decode"),
    "expert4-tensor2": (dict(expert=4, tensor=2), None),
    # the learner on devices 0-3, the engine on 4-7 (rl.engine_mesh): publishing copies shard to shard
    "fsdp4_engine_expert2-tensor2_disjoint": (dict(fsdp=4), "decode", dict(expert=2, tensor=2)),
}
RL_BATCH, RL_PROMPT, RL_NEW = 16, 16, 16
RL_CFG = RLConfig(algorithm="sao", eps_low=0.2, eps_high=4.0, alpha=1.5, gamma=1.0, actor_lr=1e-4, critic_lr=1e-3,
                  critic_steps=2, critic_warmup=0, grad_clip=1.0, temperature=1.0)
PUBLISH_CONFIGS = ("tiny", "small")
PUBLISH_REPEATS = 10


def median_time(fn, repeats):
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_mesh(config, mesh_sizes, batch, seq, repeats):
    mesh = glmjax.make_mesh(**mesh_sizes)
    with sharding.use_mesh(mesh):
        model = glmjax.init_model(config, mesh=mesh)
        graphdef, state = nnx.split(model)
        params = nnx.state(model, nnx.Param)
        ids = jax.device_put(jax.random.randint(jax.random.key(0), (batch, seq), 0, config.vocab_size),
                             jax.sharding.NamedSharding(mesh, sharding.logical_spec(("batch", "length"),
                                                                                    (batch, seq), mesh=mesh)))

        @jax.jit
        def step(p, ids):
            def loss(p):
                logits = nnx.merge(graphdef, nnx.merge_state(state, p))(ids).logits
                return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

            return jax.value_and_grad(loss)(p)

        compiled = step.lower(params, ids).compile()
        t_step = median_time(lambda: compiled(params, ids), repeats)
        share = scope_share(compiled, lambda: compiled(params, ids), "moe")
    return {"step_s": t_step, "moe_s": share * t_step, "moe_share": share}


def _under(op_name: str, scope: str) -> bool:
    """Whether an HLO op_name ("jit(step)/transpose(jvp(moe))/dot_general") lies under `scope`."""
    return any(part.strip("()").split("(")[-1] == scope for part in op_name.split("/"))


def scope_share(compiled, run, scope: str) -> float:
    """The share of one run's XLA op time spent in the top-level instructions of the
    compiled program whose op_name lies under the named scope `scope`, from a profiler
    trace of the run. Top level: the ENTRY computation's instructions, each counted once
    with whatever it calls (a while loop with its body), so nothing is counted twice."""
    entry = compiled.as_text().split("\nENTRY ", 1)[1].split("\n}", 1)[0]
    names = {m.group(1): m.group(2) for m in re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', entry,
                                                          re.M)}
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run())
        path = next(pathlib.Path(d).rglob("perfetto_trace.json.gz"))
        events = json.load(gzip.open(path))["traceEvents"]
    inside = total = 0.0
    for e in events:
        if e.get("ph") == "X" and e.get("name") in names:
            total += e["dur"]
            inside += e["dur"] if _under(names[e["name"]], scope) else 0.0
    if not total:
        raise RuntimeError("the profiler trace holds none of the program's instructions")
    return inside / total


def bench_publish(config, repeats):
    """Publish milliseconds from a learner layout into an engine layout, for three pairs."""
    devices = jax.devices()
    pairs = {
        "same_layout_swap_ms": (glmjax.make_mesh(fsdp=8), glmjax.make_mesh(fsdp=8)),
        "reshard_same_devices_ms": (glmjax.make_mesh(fsdp=8), glmjax.make_mesh(expert=4, tensor=2)),
        "reshard_disjoint_devices_ms": (glmjax.make_mesh(fsdp=4, devices=devices[:4]),
                                        glmjax.make_mesh(expert=2, tensor=2, devices=devices[4:])),
    }
    out = {}
    for key, (learner_mesh, engine_mesh) in pairs.items():
        state = nnx.state(glmjax.init_model(config, seed=0, mesh=learner_mesh))
        new = nnx.state(glmjax.init_model(config, seed=1, mesh=learner_mesh))
        store = WeightStore(state, shardings=sharding.param_shardings(state, engine_mesh))

        def publish():
            store.publish(new)
            return store.latest().state

        out[key] = 1e3 * median_time(publish, repeats)
    out["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state))
    return out


def _device_share(state) -> int:
    """The most bytes of `state` one device holds."""
    held = {}
    for x in jax.tree.leaves(state):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def bench_publish_groups(config, repeats):
    """publish_groups (module docstring)."""
    mesh = glmjax.make_mesh(fsdp=8)
    policy = glmjax.init_model(config, seed=0, mesh=mesh)
    new = nnx.state(glmjax.init_model(config, seed=1, mesh=mesh))
    groups = EngineGroups.build(policy, mesh, 2, {"expert": 2, "tensor": 2}, sharding.DECODE_RULES,
                                max_concurrent_decodes=4, max_len=64)

    def publish():
        groups.store.publish(new)
        return [s.latest().state for s in groups.store.stores]

    out = {"groups": [[d.id for d in e.mesh.devices.flat] for e in groups.engines],
           "publish_ms": 1e3 * median_time(publish, repeats)}
    moved = received_bytes(groups_publish_hlo(new, [s.shardings for s in groups.store.stores]), mesh.size)
    share = _device_share(groups.store.stores[0].latest().state)
    out.update(bytes_per_device=moved["bytes"], bytes_by_collective=moved["by_kind"], device_share_bytes=share,
               bytes_over_share=moved["bytes"] / share, param_bytes=sum(x.nbytes for x in jax.tree.leaves(new)))
    engine = glmjax.make_mesh(expert=4, tensor=2)  # XLA's direct reshard, one engine on the same devices
    target = sharding.param_shardings(new, engine, sharding.DECODE_RULES)
    direct = jax.jit(lambda t: t, out_shardings=target).lower(new).compile().as_text()
    placed = jax.jit(lambda t: t, out_shardings=target)(new)
    share = _device_share(placed)
    moved = received_bytes(direct, mesh.size)["bytes"]
    out["reshard_same_devices"] = {"bytes_per_device": moved, "device_share_bytes": share,
                                   "bytes_over_share": moved / share}
    return out


class RLArm:
    """Policy, critic, learner and engine of one RL_MESHES entry, built once."""

    def __init__(self, config, sizes, engine_rules, engine_sizes=None):
        devices = jax.devices()
        self.mesh = glmjax.make_mesh(**sizes, devices=devices[:math.prod(sizes.values())]) if sizes else None
        # the engine on the learner's devices, or on as many after them
        where = self.mesh if engine_sizes is None else glmjax.make_mesh(
            **engine_sizes, devices=devices[self.mesh.size:2 * self.mesh.size])
        rules = sharding.DECODE_RULES if engine_rules == "decode" else sharding.DEFAULT_RULES
        with self.context():
            self.policy = glmjax.init_model(config, seed=0, mesh=self.mesh)
            critic = ValueModel(nnx.clone(self.policy))
            if self.mesh is not None:
                critic = sharding.shard_model(critic, self.mesh)
            self.learner = Learner(self.policy, critic, RL_CFG, mesh=self.mesh)
            state = nnx.state(self.policy)
            shardings = None if self.mesh is None else sharding.param_shardings(state, where, rules)
            self.store = WeightStore(state, shardings=shardings)
            self.engine = GlmEngine(self.policy, weights=self.store, max_concurrent_decodes=RL_BATCH,
                                    max_len=RL_PROMPT + RL_NEW + 1, prefill_buckets=(RL_PROMPT,), mesh=where,
                                    rules=None if self.mesh is None else rules)
            self.driver = Driver(self.engine)
        self.rng = np.random.default_rng(0)

    def context(self):
        return sharding.use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def step(self) -> dict:
        """One synchronous step: generate, learn, publish. Seconds of each and CPU/wall."""
        vocab = self.policy.config.vocab_size
        cpu0, t0 = time.process_time(), time.perf_counter()
        with self.context():
            prompts = [[int(t) for t in self.rng.integers(0, vocab, RL_PROMPT)] for _ in range(RL_BATCH)]
            handles = [self.driver.submit(Request(p, RL_NEW, temperature=1.0, seed=int(self.rng.integers(1 << 30))))
                       for p in prompts]
            self.driver.run_until_idle()
            results = [h.result(timeout=0) for h in handles]
            t1 = time.perf_counter()
            batch = _batch(prompts, results, self.rng)
            self.learner.step(batch)
            t2 = time.perf_counter()
            jax.block_until_ready(self.store.latest().state)
            self.store.publish(nnx.state(self.policy))
            jax.block_until_ready(self.store.latest().state)
        t3 = time.perf_counter()
        return {"generate_s": t1 - t0, "learner_s": t2 - t1, "publish_s": t3 - t2, "step_s": t3 - t0,
                "cpu_over_wall": (time.process_time() - cpu0) / (t3 - t0)}


def _batch(prompts, results, rng) -> sao.Batch:
    """The generated rows as a learner batch, with random outcomes."""
    n, t = len(results), RL_PROMPT + RL_NEW
    tokens, mask, logp = np.zeros((n, t), np.int32), np.zeros((n, t), np.float32), np.zeros((n, t), np.float32)
    for i, (p, r) in enumerate(zip(prompts, results)):
        k = len(r.tokens)
        tokens[i, :RL_PROMPT + k] = list(p) + list(r.tokens)
        mask[i, RL_PROMPT:RL_PROMPT + k] = 1
        logp[i, RL_PROMPT:RL_PROMPT + k] = r.log_probs
    return sao.Batch(tokens=tokens, action_mask=mask, logp_rollout=logp, versions=np.zeros((n, t), np.int32),
                     rewards=rng.integers(0, 2, n).astype(np.float32), values=np.zeros((n, t), np.float32),
                     rollout_id=np.arange(n), segment_index=np.zeros(n, np.int32))


def bench_rl(repeats) -> dict:
    config = presets.model_config_from(presets.load_config(str(REPO / "configs" / "tiny.py"))).replace(
        num_nextn_predict_layers=0)
    arms = {name: RLArm(config, *spec) for name, spec in RL_MESHES.items()}
    runs = {name: [] for name in arms}
    for name, arm in arms.items():  # compile every shape first
        arm.step()
    for _ in range(repeats):  # interleaved repeat by repeat
        for name, arm in arms.items():
            runs[name].append(arm.step())
    out = {}
    for name, rows in runs.items():
        out[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        sizes, rules, *engine = RL_MESHES[name]
        out[name]["mesh"], out[name]["engine_rules"] = sizes or {}, rules or "learner"
        if engine:
            out[name]["engine_mesh"] = engine[0]
    base = out["one_device"]["step_s"]
    for r in out.values():
        r["relative_step_time"] = r["step_s"] / base
    return out


LOAD_CHILD = r"""
import json, os, resource, sys, threading, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, glmjax
import glmjax.sharding
from flax import nnx
def status():  # (anonymous, file-backed) resident bytes
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))
peaks, done = [0, 0], threading.Event()
def sample():  # every 2 ms: the peak of each kind, which ru_maxrss cannot separate
    while not done.is_set():
        anon, file = status()
        peaks[0], peaks[1] = max(peaks[0], anon), max(peaks[1], anon + file)
        time.sleep(0.002)
mesh = glmjax.make_mesh(fsdp=2, expert=2, devices=jax.devices()[:4])
anon_before, file_before = status()
threading.Thread(target=sample, daemon=True).start()
model = glmjax.from_pretrained(sys.argv[1], mesh=mesh)
jax.block_until_ready(nnx.state(model))
done.set()
held = sum(glmjax.sharding.per_device_bytes(nnx.state(model)).values())  # every device's copy counted
print(json.dumps(dict(rss_before=anon_before + file_before, anon_before=anon_before, peak=peaks[1],
                      anon_peak=peaks[0], anon_after=status()[0], array_bytes=held)))
"""


def bench_load(config) -> dict:
    """The `load` part of the module docstring."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as path:
        glmjax.save_pretrained(glmjax.init_model(config, seed=0), path)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        out = subprocess.run([sys.executable, "-c", LOAD_CHILD, path], capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    r = json.loads(out.stdout.strip().splitlines()[-1])
    excess = r["peak"] - r["rss_before"] - r["array_bytes"]
    anon = r["anon_peak"] - r["anon_before"] - r["array_bytes"]
    return {"mesh": {"fsdp": 2, "expert": 2}, "checkpoint_bytes": size, "array_bytes": r["array_bytes"],
            "peak_rss_above_start_bytes": r["peak"] - r["rss_before"], "peak_excess_over_arrays_bytes": excess,
            "peak_excess_over_checkpoint": excess / size,
            "peak_anonymous_above_start_bytes": r["anon_peak"] - r["anon_before"],
            "anonymous_after_load_above_start_bytes": r["anon_after"] - r["anon_before"],
            "peak_anonymous_excess_over_arrays_bytes": anon, "peak_anonymous_excess_over_checkpoint": anon / size}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", nargs="+", choices=("meshes", "rl", "load", "publish"),
                    default=("meshes", "rl", "load", "publish"))
    ap.add_argument("--update", action="store_true",
                    help="keep what --out already holds of the parts not run (their figures stay those of their run)")
    args = ap.parse_args(argv)
    load = lambda name: presets.model_config_from(  # noqa: E731
        presets.load_config(str(REPO / "configs" / f"{name}.py"))).replace(num_nextn_predict_layers=0)
    results = {"config": "configs/small.py", "batch": args.batch, "seq": args.seq, "devices": len(jax.devices()),
               "repeats": args.repeats, "load_average_start": os.getloadavg()[0]}
    if "meshes" in args.parts:
        config, results["meshes"] = load("small"), {}
        for name, sizes in MESHES.items():
            r = bench_mesh(config, sizes, args.batch, args.seq, args.repeats)
            results["meshes"][name] = r
            print(f"{name:24s} step {r['step_s'] * 1e3:8.1f} ms   MoE {r['moe_s'] * 1e3:8.1f} ms "
                  f"({100 * r['moe_share']:.0f}%)", flush=True)
        base = results["meshes"]["data8"]["step_s"]
        for r in results["meshes"].values():
            r["relative_step_time"] = r["step_s"] / base
    if "rl" in args.parts:
        results["rl_step"] = {"config": "configs/tiny.py", "batch": RL_BATCH, "prompt": RL_PROMPT,
                              "new_tokens": RL_NEW, "arms": bench_rl(args.repeats)}
        for name, r in results["rl_step"]["arms"].items():
            print(f"rl {name:28s} step {r['step_s'] * 1e3:8.1f} ms (generate {r['generate_s'] * 1e3:.1f}, learner "
                  f"{r['learner_s'] * 1e3:.1f}, publish {r['publish_s'] * 1e3:.1f}) cpu/wall {r['cpu_over_wall']:.2f}",
                  flush=True)
    if "load" in args.parts:
        r = results["sharded_load"] = bench_load(load("small"))
        print(f"sharded load: checkpoint {r['checkpoint_bytes'] / 1e6:.0f} MB, peak above the arrays: resident "
              f"{r['peak_excess_over_arrays_bytes'] / 1e6:.0f} MB ({r['peak_excess_over_checkpoint']:.2f} of it), "
              f"anonymous {r['peak_anonymous_excess_over_arrays_bytes'] / 1e6:.0f} MB "
              f"({r['peak_anonymous_excess_over_checkpoint']:.2f})", flush=True)
    if "publish" in args.parts:
        results["publish_repeats"], results["publish"] = PUBLISH_REPEATS, {}
        for name in PUBLISH_CONFIGS:
            r = results["publish"][f"configs/{name}.py"] = bench_publish(load(name), PUBLISH_REPEATS)
            print(f"publish {name:8s} " + "   ".join(f"{k} {v:.2f}" for k, v in r.items() if k.endswith("_ms")),
                  flush=True)
        results["publish_groups"] = {}
        for name in PUBLISH_CONFIGS:
            r = results["publish_groups"][f"configs/{name}.py"] = bench_publish_groups(load(name), PUBLISH_REPEATS)
            print(f"publish to 2 groups {name:8s} {r['publish_ms']:.2f} ms, {r['bytes_per_device'] / 1e6:.2f} MB per "
                  f"device for a {r['device_share_bytes'] / 1e6:.2f} MB share ({r['bytes_over_share']:.2f}x; XLA's "
                  f"direct reshard {r['reshard_same_devices']['bytes_over_share']:.2f}x)", flush=True)
    results["load_average_end"] = os.getloadavg()[0]  # the 8 devices share the host's cores with whatever else runs
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.update and out.exists():
        earlier = json.loads(out.read_text())
        runs = earlier.get("parts_run_at", {})
        runs.update({part: time.strftime("%Y-%m-%d") for part in args.parts})
        results = {**earlier, **results, "parts_run_at": runs}
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import floor

    floor.main_with_profile(main, "sharding_bench")  # --profile DIR: a JAX profiler trace of the run
