"""The multi-teacher on-policy distillation job: specialists in, one student out.

    glmjax-train --config configs/opd_tiny.py --workdir /tmp/opd

  1. base: a short supervised start on demonstrations of every domain (rl/base_model.py's
     recipe; cached in workdir/student_base): the student, evaluated on each domain;
  2. teachers: one specialist per task family, the base fine-tuned on that family's
     demonstrations alone and saved as an orbax teacher checkpoint (workdir/teachers/NAME);
     each is evaluated on its domain's held-out tasks;
  3. OPD rounds: draw `batches_per_round` x `batch_size` prompts from the mixed stream;
     the scheduler groups them by teacher, the active teacher's group first; for each
     group, the next teacher is prefetched while the student samples the group's answers,
     then the teacher scores the student's tokens; the round's rollouts are then trained
     on in mixed batches, in draw order, `epochs` times, with the OPD advantages
     (rl/distill/losses.py) through SAO's importance-weighted loss (whose ratio against the rollout
     log-probs corrects the reuse) plus, with opd.distribution "full" or "topk", the KL
     between the two next-token distributions at every visited position; the learning
     rate warms up, then decays (cosine) to a tenth; every update is published to the
     engine's WeightStore;
  4. the student (saved to workdir/student) is evaluated on each domain again;
     workdir/summary.json, metrics.jsonl and a table of teacher / student pass rates.

With `student.checkpoint` (a Hugging Face directory) the student's base is that checkpoint
(fine-tuned on every domain's demonstrations first with `student.finetune`), prompts and
answers are in its tokenizer and chat template, and workdir/student is a Hugging Face
directory with the checkpoint's tokenizer files.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import glmjax
from envs import families
from glmjax import distributed
from rl import base_model
from rl import rollout as ro
from rl.config import DistillJobConfig
from rl.distill import losses as opd
from rl.distill.teachers import (
    TeacherRegistry,
    TeacherSpec,
    TeacherSwitcher,
    order_by_teacher,
    save_teacher,
    score,
)
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine
from rl.engine.weights import WeightStore
from rl.evaluation import evaluate
from rl.export import export
from rl.job import on_mesh, say
from rl.learner import Learner
from rl.tasks import TaskStream, answer_stops, chat_for, prompt_tokens

log = logging.getLogger(__name__)


def domain_of(task) -> str:
    """A text task's domain: its family."""
    return task.metadata["family"]


def _demonstrations(t, n: int, seed: int):
    return families.make_tasks(t.family, n, seed=seed, difficulty=t.difficulty)


def supervised(model: glmjax.GlmForCausalLM, tasks, sft, mesh=None, chat=None) -> glmjax.GlmForCausalLM:
    """rl/base_model.py's supervised recipe on the tasks' demonstrations (in `chat`'s format
    with a checkpoint)."""
    ids, mask = base_model.demonstrations(tasks, sft.seq_len, chat=chat)
    return base_model.supervised(model, ids, mask, sft, mesh=mesh)


def student_chat(cfg):
    """The byte vocabulary, or the student checkpoint's chat format."""
    return chat_for(cfg.student.checkpoint)


def build_student(cfg, workdir: str, mesh=None) -> glmjax.GlmForCausalLM:
    """The shared base: supervised on every domain's demonstrations, cached in workdir;
    sharded by the ambient rules with a mesh."""
    s = cfg.student
    if s.checkpoint and not s.finetune:
        return base_model.load_checkpoint(s.checkpoint, cfg.model, mesh)
    path = os.path.join(workdir, "student_base")
    if os.path.exists(os.path.join(path, "config.json")):
        return glmjax.from_pretrained(path, mesh=mesh)
    if s.checkpoint:
        model = base_model.load_checkpoint(s.checkpoint, cfg.model, mesh)
    else:
        model = glmjax.init_model(cfg.model, seed=s.seed, mesh=mesh)
    supervised(model, [task for t in cfg.teachers.values() for task in _demonstrations(t, s.demonstrations, s.seed)], s,
               mesh, chat=student_chat(cfg) if s.checkpoint else None)
    glmjax.save_pretrained(model, path)
    return model


def build_teachers(cfg, workdir: str, base: glmjax.GlmForCausalLM, mesh=None) -> TeacherRegistry:
    """Each specialist: the shared base fine-tuned on its family alone (as MOPD derives its
    teachers from one base), saved as a teacher checkpoint; cached in workdir."""
    specs = []
    for name, t in sorted(cfg.teachers.items()):
        path = os.path.join(workdir, "teachers", name)
        if not os.path.exists(os.path.join(path, "config.json")):
            sft = cfg.teacher_sft_for(t)  # per-family budgets
            chat = student_chat(cfg) if cfg.student.checkpoint else None
            save_teacher(supervised(nnx.clone(base), _demonstrations(t, sft.demonstrations, sft.seed), sft, mesh, chat),
                         path)
        specs.append(TeacherSpec(name, path, (t.family,)))
    return TeacherRegistry(specs)


def heldout_tasks(cfg) -> dict[str, list]:
    return {t.family: families.make_tasks(t.family, cfg.task.eval_tasks, seed=cfg.task.seed + 1, split="heldout",
                                          difficulty=t.difficulty)
            for t in cfg.teachers.values()}


def mixed_train_tasks(cfg) -> list:
    """Every domain's training tasks, interleaved (the stream shuffles them anyway)."""
    per = [families.make_tasks(t.family, cfg.task.train_tasks, seed=cfg.task.seed, difficulty=t.difficulty)
           for _, t in sorted(cfg.teachers.items())]
    return [task for group in zip(*per) for task in group]


def pass_rates(model, tasks_by_domain, cfg, mesh=None) -> dict[str, float]:
    driver = Driver(GlmEngine(model, max_concurrent_decodes=cfg.opd.slots, max_len=cfg.task.max_len, mesh=mesh))
    chat = student_chat(cfg)
    return {d: evaluate(driver, tasks, cfg.task.max_new_tokens, chat=chat) for d, tasks in tasks_by_domain.items()}


class Scorer:
    """Teacher log-probs for a round's rollouts: grouped by teacher, the active teacher's
    group first; each group is sampled by the student, then scored by its teacher, and
    the next group's teacher loads in the background meanwhile (the module docstring's
    step 3). `prefetch_for` starts the next round's first switch early, from the queue of
    upcoming work."""

    def __init__(self, registry: TeacherRegistry, switcher: TeacherSwitcher, driver: Driver, cfg, chat=None):
        self.registry, self.switcher, self.driver, self.cfg = registry, switcher, driver, cfg
        self.chat = chat or chat_for("")  # the student's format: the byte vocabulary by default

    def _groups(self, tasks):
        return order_by_teacher([self.registry.route(domain_of(task)) for task in tasks], self.switcher.active)

    def prefetch_for(self, tasks) -> None:
        """Stages the first teacher that `tasks` will switch to."""
        upcoming = [name for name, _ in self._groups(tasks) if name != self.switcher.active]
        self.switcher.prefetch(upcoming[0] if upcoming else None)

    def rollouts(self, tasks, first_id: int, seed: int):
        """Trajectories [len(tasks)] and teacher outputs, in the order of `tasks`."""
        o, t, chat = self.cfg.opd, self.cfg.task, self.chat
        groups = self._groups(tasks)
        trajectories, teacher = [None] * len(tasks), [None] * len(tasks)
        self.switcher.prefetch(groups[0][0])  # the job's first teacher (else already active or staged)
        for g, (name, idx) in enumerate(groups):
            prompts = {i: prompt_tokens(chat, tasks[i]) for i in idx}
            handles = [self.driver.submit(Request(prompts[i], t.max_new_tokens, temperature=o.temperature,
                                                  seed=seed + first_id + i, stop_ids=answer_stops(chat)))
                       for i in idx]
            self.driver.run_until_idle()
            group = []
            for i, h in zip(idx, handles):
                res, task = h.result(), tasks[i]
                group.append(ro.Trajectory(prompts[i], res.tokens, res.log_probs, res.versions,
                                           task.verify(chat.decode(res.tokens)), rollout_id=first_id + i,
                                           task_id=task.id, difficulty=task.difficulty))
            model = self.switcher.activate(name)
            if g + 1 < len(groups):
                self.switcher.prefetch(groups[g + 1][0])  # loads while this group is scored and the next sampled
            tokens = ro.to_batch(group, length=t.max_len).tokens
            scores = score(model, tokens, o.temperature, topk=o.topk if o.distribution == "topk" else 0,
                           full=o.distribution == "full")
            scores = scores if o.distribution in opd.DISTRIBUTIONS else (scores,)
            for j, i in enumerate(idx):
                trajectories[i] = group[j]
                teacher[i] = tuple(np.asarray(x[j]) for x in scores)
        return trajectories, teacher


def train_batch(learner: Learner, trajectories, teacher, domain_ids, cfg) -> dict:
    """One OPD update on a mixed batch; returns host-side metrics."""
    o = cfg.opd
    batch = ro.to_batch(trajectories, length=cfg.task.max_len)
    logp_teacher = jnp.asarray(np.stack([x[0] for x in teacher]))
    outcome = opd.outcome_advantages(batch.rewards, jnp.asarray(domain_ids), batch.action_mask)
    adv = opd.advantages(batch.logp_rollout, logp_teacher, batch.action_mask, kl_coef=o.kl_coef, outcome=outcome,
                         outcome_weight=o.outcome_weight)
    dist = None
    if o.distribution in opd.DISTRIBUTIONS:
        dist = tuple(jnp.asarray(np.stack([x[k] for x in teacher])) for k in range(1, len(teacher[0])))
    metrics = learner.step(batch, advantages=adv, teacher=dist)
    kl = opd.reverse_kl(batch.logp_rollout, logp_teacher, batch.action_mask)
    m = np.asarray(batch.action_mask)
    metrics["reverse_kl"] = float(np.sum(np.asarray(kl)) / max(m.sum(), 1.0))
    metrics["reward"] = float(np.mean(np.asarray(batch.rewards)))
    return metrics


def check_config(cfg) -> DistillJobConfig:
    """The typed config (rl/config.py); a ValueError names the first field the job cannot
    run, before any model trains."""
    return DistillJobConfig.from_config(cfg)


def run(cfg, workdir: str) -> dict:
    """The job (module docstring). With `config.mesh` (glmjax/distributed.py) the student,
    the teachers and the engine are split over it by `config.rules`, in one layout (so
    publishing stays a reference swap), and learner batches are global arrays."""
    job = check_config(cfg)
    return on_mesh(job.raw, workdir, lambda mesh, rules: _run(job, workdir, mesh, rules))


def _run(cfg, workdir: str, mesh, rules) -> dict:
    start = time.time()
    o = cfg.opd
    if mesh is not None:
        say(f"student, teachers and engine on {distributed.describe(mesh)}")
    student = build_student(cfg, workdir, mesh)
    registry = build_teachers(cfg, workdir, student, mesh)
    heldout = heldout_tasks(cfg)
    teacher_rates = {}
    with TeacherSwitcher(registry, prefetch=False, device=mesh, rules=rules) as loader:
        for name in sorted(registry.specs):
            (domain,) = registry[name].domains
            teacher_rates[domain] = pass_rates(loader.activate(name), {domain: heldout[domain]}, cfg, mesh)[domain]
    base_rates = pass_rates(student, heldout, cfg, mesh)
    for d in heldout:
        print(f"{d}: teacher {registry.route(d)} {teacher_rates[d]:.1%}, student before OPD {base_rates[d]:.1%}",
              flush=True)

    total_steps = o.rounds * o.batches_per_round * o.epochs
    # Warm-up, then cosine decay to a tenth over the job: the last updates average out the
    # noise of a few dozen rollouts per batch instead of stepping at the full rate.
    lr = optax.warmup_cosine_decay_schedule(o.actor_lr / 10, o.actor_lr, o.warmup, max(total_steps, o.warmup + 1),
                                            end_value=o.actor_lr / 10)
    learner = Learner(student, None, o.learner(), external_advantages=True, distill=o.distillation(), actor_lr=lr,
                      mesh=mesh)
    store = WeightStore(nnx.state(student))
    driver = Driver(GlmEngine(student, weights=store, max_concurrent_decodes=o.slots, max_len=cfg.task.max_len,
                              mesh=mesh, rules=rules))
    switcher = TeacherSwitcher(registry, prefetch=o.prefetch, device=mesh, rules=rules)
    scorer = Scorer(registry, switcher, driver, cfg, chat=student_chat(cfg))
    stream = TaskStream(mixed_train_tasks(cfg), seed=cfg.task.seed)
    domains = {d: i for i, d in enumerate(sorted(heldout))}
    history = open(os.path.join(workdir, "metrics.jsonl"), "w")
    step, rollouts, opd_start = 0, 0, time.time()
    bar = tqdm(total=total_steps, desc="OPD", mininterval=1.0)
    draw = lambda: [next(stream) for _ in range(o.batches_per_round * o.batch_size)]  # noqa: E731
    tasks = draw()
    for r in range(o.rounds):
        trajectories, teacher = scorer.rollouts(tasks, rollouts, cfg.seed * 1_000_003)
        upcoming = draw() if r + 1 < o.rounds else []
        scorer.prefetch_for(upcoming)  # the next round's first switch loads while this round trains
        for b in [b for _ in range(o.epochs) for b in range(o.batches_per_round)]:
            rows = slice(b * o.batch_size, (b + 1) * o.batch_size)
            metrics = train_batch(learner, trajectories[rows], teacher[rows],
                                  [domains[domain_of(t)] for t in tasks[rows]], cfg)
            store.publish(nnx.state(student))
            step += 1
            history.write(json.dumps({"step": step, "version": store.version, "time": time.time() - start,
                                      "switches": switcher.stats.switches, **metrics}) + "\n")
            history.flush()
            bar.update(1)
            bar.set_postfix(kl=f"{metrics['reverse_kl']:.3f}", reward=f"{metrics['reward']:.2f}")
        rollouts += len(tasks)
        tasks = upcoming
    bar.close()
    history.close()
    opd_seconds = time.time() - opd_start
    switcher.close()

    export(student, os.path.join(workdir, "student"), tokenizer_from=cfg.student.checkpoint)
    final_rates = pass_rates(student, heldout, cfg, mesh)
    stats = switcher.stats
    summary = {
        "teachers": {name: {"domains": list(spec.domains), "pass_rate": teacher_rates[spec.domains[0]]}
                     for name, spec in registry.specs.items()},
        "student_base_pass_rate": base_rates, "student_pass_rate": final_rates,
        "student_over_teacher": {d: final_rates[d] / max(teacher_rates[d], 1e-9) for d in heldout},
        "goal_met": all(final_rates[d] >= 0.9 * teacher_rates[d] for d in heldout),
        "steps": step, "rollouts": rollouts, "heldout_tasks": {d: len(t) for d, t in heldout.items()},
        "switches": stats.switches, "cold_loads": stats.cold_loads, "stall_seconds": stats.stall_seconds,
        "background_load_seconds": stats.load_seconds, "peak_host_teachers": stats.peak_host_teachers,
        "teacher_idle_share": stats.stall_seconds / max(opd_seconds, 1e-9), "opd_seconds": opd_seconds,
        "wall_seconds": time.time() - start, "prefetch": o.prefetch, "distribution": o.distribution,
        "topk": o.topk if o.distribution == "topk" else None, "beta": o.beta,
        "outcome_weight": o.outcome_weight,
    }
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(format_table(summary), flush=True)
    return summary


def format_table(s: dict) -> str:
    teacher_of = {d: (name, t["pass_rate"]) for name, t in s["teachers"].items() for d in t["domains"]}
    header = ("domain", "teacher", "teacher", "student base", "student OPD", "student/teacher")
    rows = [(d, teacher_of[d][0], f"{teacher_of[d][1]:.1%}", f"{s['student_base_pass_rate'][d]:.1%}",
             f"{s['student_pass_rate'][d]:.1%}", f"{s['student_over_teacher'][d]:.0%}")
            for d in sorted(s["student_pass_rate"])]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines = [fmt(header), *map(fmt, rows)]
    lines.append(f"{s['steps']} OPD steps, {s['rollouts']} rollouts, {s['switches']} teacher switches "
                 f"({s['stall_seconds']:.2f} s stalled, {s['cold_loads']} cold loads), {s['wall_seconds']:.0f} s; "
                 f"goal (student >= 90% of teacher everywhere) {'met' if s['goal_met'] else 'not met'}")
    return "\n".join(lines)
