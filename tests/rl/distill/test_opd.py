"""Multi-teacher on-policy distillation: the signal, routing, switching with prefetch, the job."""

import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import glmjax
from envs import families
from rl import sao
from rl.config import RLConfig
from rl.distill import losses as opd
from rl.distill import teachers
from rl.distill import trainer as opd_trainer
from rl.engine.driver import Driver
from rl.engine.engine import GlmEngine
from rl.learner import Learner, token_logprobs

REPO = pathlib.Path(__file__).resolve().parents[3]
# Byte vocabulary (prompts are encoded text), two layers: every mechanism, compiled quickly.
CONFIG = glmjax.ModelConfig(
    vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
    index_topk=8, index_n_heads=2, index_head_dim=8, index_topk_pattern="FS", initializer_range=0.1,
    max_position_embeddings=64, num_nextn_predict_layers=0,
)


# The signal ------------------------------------------------------------------------------
def test_reverse_kl_advantage_matches_hand_computed_values():
    logp_s = jnp.asarray([[0.0, -1.0, -0.5, -2.0], [0.0, -0.1, -3.0, -0.7]])
    logp_t = jnp.asarray([[-9.0, -0.2, -1.5, -2.0], [0.0, -0.4, -1.0, -5.0]])
    mask = jnp.asarray([[0, 1, 1, 0], [0, 1, 1, 1]], jnp.float32)
    # kl = s - t on action tokens:   row 0: -0.8, 1.0       row 1: 0.3, -2.0, 4.3
    np.testing.assert_allclose(opd.reverse_kl(logp_s, logp_t, mask), [[0, -0.8, 1.0, 0], [0, 0.3, -2.0, 4.3]],
                               atol=1e-6)
    np.testing.assert_allclose(opd.advantages(logp_s, logp_t, mask, kl_coef=0.5),
                               [[0, 0.4, -0.5, 0], [0, -0.15, 1.0, -2.15]], atol=1e-6)
    # Outcome: rewards (1, 0) in one domain -> baseline 0.5 -> (+0.5, -0.5); weight 2 -> (+1, -1).
    outcome = opd.outcome_advantages(jnp.asarray([1.0, 0.0]), jnp.asarray([3, 3]), mask)
    np.testing.assert_allclose(outcome, [[0, 0.5, 0.5, 0], [0, -0.5, -0.5, -0.5]], atol=1e-6)
    np.testing.assert_allclose(opd.advantages(logp_s, logp_t, mask, kl_coef=0.5, outcome=outcome, outcome_weight=2.0),
                               [[0, 1.4, 0.5, 0], [0, -1.15, 0.0, -3.15]], atol=1e-6)
    # Different domains: each row is its own baseline, so the outcome advantage is 0.
    np.testing.assert_allclose(opd.outcome_advantages(jnp.asarray([1.0, 0.0]), jnp.asarray([0, 1]), mask), 0.0)


def _log_softmax_np(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _mixed_kl_np(s, t, beta):  # probabilities over the last axis
    return beta * np.sum(s * np.log(s / t), -1) + (1 - beta) * np.sum(t * np.log(t / s), -1)


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.3])
def test_topk_kl_matches_numpy(beta):
    rng = np.random.default_rng(0)
    b, t, n, k = 2, 5, 11, 4
    student = _log_softmax_np(rng.normal(size=(b, t, n)))
    ids = np.stack([rng.permutation(n)[:k] for _ in range(b * t)]).reshape(b, t, k)
    teacher = np.log(rng.dirichlet(np.ones(k), size=(b, t)) * 0.7)  # top-k mass 0.7, unnormalised
    mask = (rng.random((b, t)) > 0.3).astype(np.float32)
    expected = np.zeros((b, t))
    for i in range(b):
        for j in range(t):  # the K ids and one bucket for the rest of the vocabulary
            ps = np.exp(student[i, j, ids[i, j]])
            ps = np.append(ps, 1 - ps.sum())
            pt = np.exp(teacher[i, j])
            pt = np.append(pt, 1 - pt.sum())
            expected[i, j] = mask[i, j] * _mixed_kl_np(ps, pt, beta)
    got = opd.topk_kl(jnp.asarray(student), jnp.asarray(ids), jnp.asarray(teacher), jnp.asarray(mask), beta)
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.3])
def test_full_kl_matches_numpy(beta):
    rng = np.random.default_rng(1)
    b, t, n = 2, 5, 13
    student, teacher = (_log_softmax_np(2 * rng.normal(size=(b, t, n))) for _ in range(2))
    mask = (rng.random((b, t)) > 0.3).astype(np.float32)
    expected = mask * _mixed_kl_np(np.exp(student), np.exp(teacher), beta)
    got = opd.full_kl(jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(mask), beta)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_full_kl_gradient_reaches_every_token_of_the_vocabulary():
    """d/dz KL(softmax(z) || t) = p (log p - log t - KL) and d/dz KL(t || softmax(z)) = p - t,
    for every logit z_v, not just the sampled token's."""
    rng = np.random.default_rng(2)
    n = 9
    z, teacher = rng.normal(size=n), _log_softmax_np(rng.normal(size=n))
    p = np.exp(_log_softmax_np(z))
    reverse = np.sum(p * (np.log(p) - teacher))
    for beta, expected in ((1.0, p * (np.log(p) - teacher - reverse)), (0.0, p - np.exp(teacher))):
        grad = jax.grad(lambda x: opd.full_kl(jax.nn.log_softmax(x)[None, None], jnp.asarray(teacher)[None, None],
                                              jnp.ones((1, 1)), beta).sum())(jnp.asarray(z, jnp.float32))
        np.testing.assert_allclose(grad, expected, atol=1e-5)
        assert np.all(np.abs(np.asarray(grad)) > 0)


# Teachers --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_teachers(tmp_path_factory):
    """Three random teachers saved as checkpoints: (registry, {name: the in-memory model})."""
    root = tmp_path_factory.mktemp("teachers")
    models, specs = {}, []
    for i, (name, domains) in enumerate([("sorter", ("sorting",)), ("speller", ("strings",)),
                                         ("reckoner", ("arithmetic", "program"))]):
        models[name] = glmjax.init_model(CONFIG, seed=10 + i)
        teachers.save_teacher(models[name], str(root / name))
        specs.append(teachers.TeacherSpec(name, str(root / name), domains))
    return teachers.TeacherRegistry(specs), models


def _tokens(seed=0, b=3, t=12):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (b, t)), jnp.int32)


def test_registry_routes_each_domain_to_its_teacher(saved_teachers):
    registry, _ = saved_teachers
    tasks = [families.make_tasks(f, 2, seed=0, difficulty=2) for f in ("sorting", "strings", "arithmetic", "program")]
    expected = {"sorting": "sorter", "strings": "speller", "arithmetic": "reckoner", "program": "reckoner"}
    for group in tasks:
        for task in group:
            assert registry.route(opd_trainer.domain_of(task)) == expected[task.metadata["family"]]
    with pytest.raises(KeyError, match="no teacher for domain 'poetry'"):
        registry.route("poetry")
    with pytest.raises(ValueError, match="domain 'sorting' has two teachers"):
        teachers.TeacherRegistry([teachers.TeacherSpec("a", "/x", ("sorting",)),
                                  teachers.TeacherSpec("b", "/y", ("sorting",))])
    names = ["speller", "sorter", "speller", "reckoner", "sorter"]
    assert teachers.order_by_teacher(names, active="sorter") == [("sorter", [1, 4]), ("speller", [0, 2]),
                                                                 ("reckoner", [3])]


@pytest.mark.parametrize("distribution", ["sampled", "full"])
def test_scorer_scores_each_prompt_with_its_domains_teacher(saved_teachers, distribution):
    registry, models = saved_teachers
    cfg = ml_collections.ConfigDict(dict(
        task=dict(max_len=32, max_new_tokens=4),
        opd=dict(temperature=1.0, distribution=distribution, topk=0)))
    tasks = [t for f in ("sorting", "strings", "arithmetic") for t in families.make_tasks(f, 2, seed=0, difficulty=1)]
    tasks = [tasks[i] for i in (0, 2, 4, 1, 3, 5)]  # mixed domains
    student = glmjax.init_model(CONFIG, seed=0)
    with teachers.TeacherSwitcher(registry) as switcher:
        scorer = opd_trainer.Scorer(registry, switcher, Driver(GlmEngine(student, max_concurrent_decodes=4,
                                                                         max_len=32)), cfg)
        trajectories, scores = scorer.rollouts(tasks, first_id=0, seed=0)
        assert switcher.stats.switches == 2  # three teachers, each once: work grouped by domain
    for task, tr, (logp, *dist) in zip(tasks, trajectories, scores):
        teacher = models[registry.route(opd_trainer.domain_of(task))]
        tokens = jnp.asarray([tr.prompt + tr.completion], jnp.int32)
        expected = np.asarray(token_logprobs(teacher, tokens)[0])[0]
        np.testing.assert_allclose(logp[:tokens.shape[1]], expected, atol=1e-5)
        if distribution == "full":  # row t: the teacher's distribution of token t given tokens[:t]
            logits = np.asarray(teacher(tokens).logits, np.float64)[0, :-1]
            np.testing.assert_allclose(dist[0][1:tokens.shape[1]], _log_softmax_np(logits), atol=1e-5)
            sampled = np.take_along_axis(dist[0][:tokens.shape[1]], np.asarray(tokens[0])[:, None], 1)[:, 0]
            np.testing.assert_allclose(sampled[1:], expected[1:], atol=1e-5)


def test_prefetched_switch_scores_like_a_cold_load(saved_teachers):
    registry, models = saved_teachers
    tokens = _tokens()
    with teachers.TeacherSwitcher(registry, prefetch=False) as cold:
        cold.activate("sorter")
        cold_scores = np.asarray(cold.score("speller", tokens))
        assert cold.stats.cold_loads == 2
    with teachers.TeacherSwitcher(registry, prefetch=True) as warm:
        warm.activate("sorter")
        warm.prefetch("speller")
        warm_scores = np.asarray(warm.score("speller", tokens))
        assert warm.stats.cold_loads == 1 and warm.stats.switches == 1  # only the first activation was cold
        _, top_ids, top_logp = warm.score("speller", tokens, topk=3)
        full_logp, full_logp_all = warm.score("speller", tokens, full=True)
    np.testing.assert_array_equal(warm_scores, cold_scores)
    np.testing.assert_array_equal(full_logp, warm_scores)
    expected = np.asarray(token_logprobs(models["speller"], tokens)[0])  # the model before it was saved
    np.testing.assert_allclose(warm_scores, expected, atol=1e-6)
    logits = np.asarray(models["speller"](tokens).logits, np.float64)[:, :-1]
    logp_all = logits - logits.max(-1, keepdims=True)
    logp_all -= np.log(np.exp(logp_all).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(top_logp)[:, 1:], -np.sort(-logp_all, -1)[..., :3], atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(logp_all, np.asarray(top_ids)[:, 1:], -1),
                               np.asarray(top_logp)[:, 1:], atol=1e-5)
    np.testing.assert_allclose(np.asarray(full_logp_all)[:, 1:], logp_all, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(full_logp_all)[:, 0], 0.0)


def test_prefetch_never_holds_more_than_two_teachers_in_host_memory(saved_teachers, monkeypatch):
    registry, _ = saved_teachers
    alive, peak, lock = [], [0], threading.Lock()
    real = teachers.load_host

    def counted(spec):  # host copies alive right now, counted by the garbage collector, not the switcher
        gc.collect()
        with lock:
            before = sum(r() is not None for r in alive)
        time.sleep(0.05)  # a slow disk: the loads overlap the caller's work
        host = real(spec)
        with lock:
            alive.append(weakref.ref(host))
            peak[0] = max(peak[0], before + 1)
        return host

    monkeypatch.setattr(teachers, "load_host", counted)
    order = ["sorter", "speller", "reckoner", "sorter", "reckoner", "speller", "sorter", "speller", "reckoner"]
    tokens = _tokens()
    with teachers.TeacherSwitcher(registry) as switcher:
        for i, name in enumerate(order):
            switcher.score(name, tokens)
            assert len(switcher.host_resident()) <= 2
            if i + 1 < len(order):
                switcher.prefetch(order[i + 1])
        assert switcher.stats.switches == len(order) - 1 and switcher.stats.cold_loads == 1
        assert switcher.stats.peak_host_teachers == 2
    assert len(alive) >= len(set(order)) and peak[0] <= 2


def _student_batch(seed: int, rows: int, length: int = 10, prompt: int = 4):
    """A fresh student, random tokens [rows, length] whose first `prompt` are the prompt,
    the student's own log-probs of them, and the learner batch of them (zero rewards)."""
    tokens = _tokens(seed=seed, b=rows, t=length)
    mask = jnp.asarray(np.arange(length)[None, :] >= prompt, jnp.float32) * jnp.ones((rows, 1))
    student = glmjax.init_model(CONFIG, seed=0)
    logp, _ = token_logprobs(student, tokens)
    batch = sao.Batch(tokens=tokens, action_mask=mask, logp_rollout=logp, versions=jnp.zeros((rows, length), jnp.int32),
                      rewards=jnp.zeros(rows), values=jnp.zeros((rows, length)), rollout_id=jnp.arange(rows),
                      segment_index=jnp.zeros(rows, jnp.int32))
    return student, tokens, mask, logp, batch


@pytest.mark.parametrize("distribution", ["topk", "full"])
def test_distill_step_lowers_the_distribution_kl(saved_teachers, distribution):
    registry, models = saved_teachers
    student, tokens, mask, _, batch = _student_batch(seed=1, rows=4)
    teacher = teachers.score(models["sorter"], tokens, topk=8 if distribution == "topk" else 0,
                             full=distribution == "full")[1:]
    cfg = RLConfig(algorithm="sao", eps_low=0.2, eps_high=4.0, actor_lr=3e-3, grad_clip=1.0, temperature=1.0)
    learner = Learner(student, None, cfg, external_advantages=True,
                      distill=opd.Distillation(distribution=distribution, beta=1.0, dist_weight=1.0))
    with pytest.raises(ValueError, match="expected advantages=\\[B, T\\]"):
        learner.step(batch, teacher=teacher)
    with pytest.raises(ValueError, match="a teacher's distribution goes with"):
        learner.step(batch, advantages=jnp.zeros((4, 10)))
    with pytest.raises(ValueError, match="opd.beta=2.0 is invalid"):
        opd.Distillation(distribution=distribution, beta=2.0)
    # Before any update the policy loss with zero advantages is 0 and the KL is the hand-made one.
    student_all = jax.nn.log_softmax(student(tokens).logits[:, :-1], -1)
    student_all = jnp.pad(student_all, ((0, 0), (1, 0), (0, 0)))
    kl = (opd.topk_kl(student_all, *teacher, mask) if distribution == "topk" else
          opd.full_kl(student_all, *teacher, mask))
    first = learner.step(batch, advantages=jnp.zeros((4, 10)), teacher=teacher)
    np.testing.assert_allclose(first["dist_kl"], float(kl.sum() / mask.sum()), rtol=1e-5)
    assert first["policy_loss"] == 0.0
    for _ in range(4):
        last = learner.step(batch, advantages=jnp.zeros((4, 10)), teacher=teacher)
    assert last["dist_kl"] < first["dist_kl"] and learner.steps == 5 and learner.skipped == 0


def test_learner_step_with_opd_advantages_moves_the_sampled_tokens():
    student, tokens, mask, logp0, batch = _student_batch(seed=2, rows=2)
    # The teacher likes row 0's tokens more than the student does and row 1's less.
    adv = opd.advantages(logp0, logp0 + jnp.asarray([[1.0], [-1.0]]), mask)
    cfg = RLConfig(algorithm="sao", eps_low=0.2, eps_high=4.0, actor_lr=1e-3, grad_clip=1.0, temperature=1.0)
    metrics = Learner(student, None, cfg, external_advantages=True).step(batch, advantages=adv)
    gain = np.asarray((token_logprobs(student, tokens)[0] - logp0) * mask).sum(1)
    assert gain[0] > 0 > gain[1] and np.isfinite(metrics["policy_loss"])


# The job ---------------------------------------------------------------------------------
# two layers (a full indexer and a shared one) compile in about half the time of four
SMALL = ["--config.model.num_hidden_layers=2", "--config.model.index_topk_pattern=FS",
         "--config.teachers.sorter.steps=4", "--config.teachers.speller.steps=4", "--config.student.steps=4",
         "--config.teachers.speller.demonstrations=64", "--config.teacher_sft.demonstrations=64",
         "--config.student.demonstrations=32", "--config.task.eval_tasks=4", "--config.task.train_tasks=40",
         "--config.opd.rounds=2", "--config.opd.batches_per_round=2", "--config.opd.epochs=1",
         "--config.opd.batch_size=4", "--config.opd.slots=8"]


def _opd_job(workdir, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(REPO / ".jax_cache"),
               PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "rl.cli", "--config", str(REPO / "configs" / "opd_tiny.py"), "--workdir",
           str(workdir), *SMALL, *extra]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_device_job(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("opd")
    return workdir, _opd_job(workdir)


@pytest.mark.parametrize("mesh", [False, True], ids=["one-device", "mesh"])
def test_opd_job_end_to_end(tmp_path, one_device_job, mesh):
    """The job on one device, and on fsdp=2 x expert=2 of the 8 fake devices from the same
    cached student base and teachers (loaded split over the mesh, as are the engine and
    the learner's batches)."""
    if mesh:
        for cached in ("student_base", "teachers"):
            shutil.copytree(one_device_job[0] / cached, tmp_path / cached)
        out = _opd_job(tmp_path, "--config.mesh.fsdp=2", "--config.mesh.expert=2")
        assert "student, teachers and engine on mesh fsdp=2, expert=2 of 4 cpu devices" in out.stdout
    else:
        tmp_path, out = one_device_job
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["rollouts"] == 16
    assert set(summary["student_pass_rate"]) == {"sorting", "strings"}
    assert {n: t["domains"] for n, t in summary["teachers"].items()} == {"sorter": ["sorting"],
                                                                         "speller": ["strings"]}
    assert summary["switches"] >= 1 and summary["cold_loads"] == 0 and summary["peak_host_teachers"] <= 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["reverse_kl"]) for r in rows)
    assert "student/teacher" in out.stdout and "teacher switches" in out.stdout
    for name in ("sorter", "speller"):
        teacher = tmp_path / "teachers" / name
        assert (teacher / "config.json").exists() and (teacher / "params").is_dir()
