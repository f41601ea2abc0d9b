"""Teacher switching in multi-teacher OPD: the stall a prefetched switch leaves visible.

    python benchmarks/opd_bench.py --out results/opd_bench.json

N teachers (random weights: only time is measured) are saved as orbax teacher checkpoints
(rl/distill/teachers.py). Then, as the OPD job runs its rounds (rl/distill/trainer.py, Scorer): for
each domain in turn the student samples a group of answers with the engine and the
domain's teacher scores them; right after each switch the next teacher in the queue of
work is prefetched, so it loads while this group is scored and the next one sampled. The schedule runs twice,
with prefetch and with cold loads (read from disk and put on the device when needed).

Reported:
  cold_load_seconds                median time to bring a teacher from disk to the device
  prefetched_stall_seconds         mean wait at a switch with prefetch (the visible stall)
  switch_stall_over_cold_load      the two divided (goal <= 0.1)
  teacher_idle_share               share of the schedule's accelerator time spent idle,
                                   waiting for a teacher to be loaded, with prefetch
  teacher_idle_share_cold          the same with cold loads
  scoring_share                    share spent scoring (teachers busy)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

import glmjax
from envs import families
from glmjax.presets import load_config, model_config_from
from rl import rollout as ro
from rl.distill import teachers
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("sorting", "strings", "arithmetic")


def _configs(width: int):
    tiny = model_config_from(load_config(os.path.join(REPO, "configs", "tiny.py"))).replace(max_position_embeddings=64)
    teacher = tiny.replace(hidden_size=width, intermediate_size=2 * width, moe_intermediate_size=width // 2,
                           q_lora_rank=width // 2, kv_lora_rank=width // 2)
    return tiny, teacher


def _schedule(registry, student_driver, groups, rounds, prefetch, max_len):
    """Rounds over the domain groups, each round starting with the active teacher; after
    each switch the next teacher in the queue is prefetched. Returns (wall seconds,
    scoring seconds, the stall of each switch)."""
    work = [g for r in range(rounds) for g in (groups if r % 2 == 0 else groups[::-1])]
    switcher = teachers.TeacherSwitcher(registry, prefetch=prefetch)
    switcher.activate(work[0][0])  # the job's first teacher: loaded before the clock starts
    first_stalls = len(switcher.stats.stalls)
    scoring, t0 = 0.0, time.perf_counter()
    for i, (name, tasks) in enumerate(work):
        handles = [student_driver.submit(Request(ro.encode(t.prompt), 10, temperature=1.0, seed=j,
                                                 stop_ids=ro.encode("\n"))) for j, t in enumerate(tasks)]
        student_driver.run_until_idle()
        rows = [ro.encode(t.prompt) + h.result().tokens for t, h in zip(tasks, handles)]
        tokens = np.zeros((len(rows), max_len), np.int32)
        for j, row in enumerate(rows):
            tokens[j, :len(row)] = row
        model = switcher.activate(name)
        switcher.prefetch(next((n for n, _ in work[i + 1:] if n != name), None))
        s = time.perf_counter()
        jax.block_until_ready(teachers.score(model, tokens))
        scoring += time.perf_counter() - s
    wall = time.perf_counter() - t0
    stalls = switcher.stats.stalls[first_stalls:]
    switcher.close()
    return wall, scoring, stalls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--teachers", type=int, default=3)
    parser.add_argument("--teacher-width", type=int, default=256, help="teachers' hidden size (tiny's is 64)")
    parser.add_argument("--group", type=int, default=64, help="prompts per domain group")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="cold loads timed per teacher")
    args = parser.parse_args(argv)

    student_cfg, teacher_cfg = _configs(args.teacher_width)
    max_len = 32
    with tempfile.TemporaryDirectory() as root:
        specs = []
        for i in range(args.teachers):
            path = os.path.join(root, f"teacher{i}")
            teachers.save_teacher(glmjax.init_model(teacher_cfg, seed=i), path)
            specs.append(teachers.TeacherSpec(f"teacher{i}", path, (FAMILIES[i % len(FAMILIES)] + f"-{i}",)))
        registry = teachers.TeacherRegistry(specs)
        nbytes = teachers.load_host(specs[0]).nbytes

        # Compile the scoring and the student's engine once, outside every measurement.
        warm = teachers.to_device(teachers.load_host(specs[0]))
        jax.block_until_ready(teachers.score(warm, np.zeros((args.group, max_len), np.int32)))
        del warm
        cold = []
        for spec in specs:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                model = teachers.to_device(teachers.load_host(spec))
                cold.append(time.perf_counter() - t0)
                del model
        cold_load = statistics.median(cold)

        driver = Driver(GlmEngine(glmjax.init_model(student_cfg, seed=99), max_concurrent_decodes=args.group,
                                  max_len=max_len))
        groups = [(spec.name, families.make_tasks(FAMILIES[i % len(FAMILIES)], args.group, seed=i, difficulty=1))
                  for i, spec in enumerate(specs)]
        _schedule(registry, driver, groups, 1, True, max_len)  # warm-up: engine buckets compile here
        wall, scoring, stalls = _schedule(registry, driver, groups, args.rounds, True, max_len)
        wall_cold, scoring_cold, stalls_cold = _schedule(registry, driver, groups, args.rounds, False, max_len)

    prefetched = statistics.fmean(stalls)
    result = {
        "switch_stall_over_cold_load": prefetched / cold_load,
        "teacher_idle_share": sum(stalls) / wall,
        "teacher_idle_share_cold": sum(stalls_cold) / wall_cold,
        "scoring_share": scoring / wall,
        "cold_load_seconds": cold_load,
        "prefetched_stall_seconds": prefetched,
        "prefetched_stall_max_seconds": max(stalls),
        "cold_switch_stall_seconds": statistics.fmean(stalls_cold),
        "switches": len(stalls),
        "schedule_seconds": wall,
        "schedule_seconds_cold": wall_cold,
        "teachers": args.teachers,
        "teacher_params_bytes": nbytes,
        "teacher_width": args.teacher_width,
        "group": args.group,
        "rounds": args.rounds,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import floor

    floor.main_with_profile(main, "opd_bench")  # --profile DIR: a JAX profiler trace of the run
