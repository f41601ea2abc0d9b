"""The rollout engine, measured: decode throughput against transformers, MTP speculation,
router utilisation and the cost of publishing weights. All in one run, JSON out.

    python benchmarks/engine_bench.py --out results/engine_bench.json

* decode: configs/small.py (random weights, no MTP layer), written by
  glmjax.save_pretrained and read by transformers, fp32 weights and compute on both sides
  (`decode_dtype_*`). The same workload
  for both: `batch` prompts of 64 tokens, greedy, --new-tokens each; transformers'
  `generate` vs glmjax's Driver (continuous batching, all requests submitted at once,
  prefill included). Also the share of greedy tokens on which the two agree, and the
  ratio to transformers' figures on a quiet machine (HF_QUIET_TOKENS_PER_S).
  `*_steady_*`: decode alone, the same way on both sides: (time for --new-tokens tokens
  less the time for 1) over new_tokens - 1, so prefill drops out.
  `*_floor_*`: the fastest any implementation could run the same workload here, from this
  run's measured matmul rate and read bandwidth (benchmarks/floor.py): prefill's FLOPs at
  the matmul rate, then per decode step the larger of its FLOPs at that rate and its bytes
  (non-expert weights, the experts a batch touches under uniform routing, the cache rows)
  at the bandwidth. `decode_b*_over_floor`: steady decode over the steady floor;
  `prefill_b*_over_floor`: the prefill floor over the time of prefill and one token.
* mtp: configs/tiny.py trained --mtp-steps steps on the two-lag Markov corpus of
  glmjax/train.py (LM + depth-1 MTP loss + the DSA sparse stage); then, per draft mode
  ("own" MTP cache, "shared" main-model latents and top-k: rl/engine/speculative.py), a copy
  whose MTP layer is fine-tuned --draft-steps steps to draft recursively at depths 1..5
  (glmjax/train.py's multi-depth `mtp_loss`, only the MTP layer trainable). Greedy decoding of held-out prompts at batch 1 with 5 drafts:
  accepted drafts per step (0..5; tokens per step is that plus one) and tokens/s against
  the same engine without drafts.
* mtp_main_job: the same speculation on the main job's own base model (configs/sao_tiny.py,
  its SFT base trained here) over its held-out prompts, sampled at the RL temperature, at
  the job's serving batch and at batch 1: `mtp_accept_len_main_job` and the speedup.
* quant: rl/engine/quant.py's weight-only quantization of the routed experts (bf16, int8, int4)
  against the fp32 weights: on the MTP section's trained tiny model, the logit error and
  top-1 agreement on held-out sequences and the share of greedy tokens that match; on
  configs/small.py, decode tokens/s at batch 8 (same workload as the decode section).
* router: two tiny engines of 8 slots; requests with log-normal lengths; utilisation =
  busy slot-seconds / (slots x makespan), through the router (continuous batching,
  dispatch on free capacity; `router_utilization` with the longest token budget first,
  `router_utilization_fifo` in arrival order) and with a static schedule (requests split round-robin in
  advance, run in batches of 8 that each wait for their longest member). The router's
  figure also up to the moment its queue empties (`_while_queued`): after that the
  workload drains, whatever the scheduler.
* publish: WeightStore.publish of the tiny and the small model's parameters.
Decode times are the best of --repeats runs on each side (the machine is shared);
publish times are medians. --profile DIR writes a JAX profiler trace of the engine's
decode at each batch. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import floor  # noqa: E402

import glmjax  # noqa: E402
from glmjax import presets, train  # noqa: E402
from rl.engine import quant  # noqa: E402
from rl.engine.driver import Driver, Request  # noqa: E402
from rl.engine.engine import GlmEngine  # noqa: E402
from rl.engine.router import Router  # noqa: E402
from rl.engine.weights import WeightStore  # noqa: E402

PROMPT_LEN = 64
# transformers' greedy generate on configs/small.py, tokens/s, measured on this 2-core machine
# when it was quiet (shared/notes/ecosystem.md). Under load transformers slows far more
# than glmjax does, so the same-run ratio flatters glmjax; both ratios are reported.
HF_QUIET_TOKENS_PER_S = {1: 18.0, 8: 56.0, 64: 93.0}


def _config(name: str, **changes) -> glmjax.ModelConfig:
    return presets.model_config_from(presets.load_config(REPO / "configs" / f"{name}.py")).replace(**changes)


def _run(driver: Driver, requests) -> tuple[list, float]:
    start = time.perf_counter()
    handles = [driver.submit(r) for r in requests]
    driver.run_until_idle()
    return [h.result() for h in handles], time.perf_counter() - start


# Decode against transformers -----------------------------------------------------------
def bench_decode(args, results: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    config = _config("small", num_nextn_predict_layers=0)
    model = glmjax.init_model(config, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        glmjax.save_pretrained(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    results["decode_dtype_glmjax"] = f"params {config.param_dtype}, compute {config.dtype}"
    results["decode_dtype_transformers"] = "params float32, compute float32"
    rng = np.random.default_rng(0)
    n = args.new_tokens
    ceiling = results["ceiling"] = floor.measure_ceiling()
    results["machine_matmul_gflops"], results["machine_read_gb_per_s"] = ceiling["matmul_gflops"], ceiling["read_gb_per_s"]
    for b in args.batches:
        prompts = rng.integers(2, config.vocab_size, (b, PROMPT_LEN))
        engine = GlmEngine(model, max_concurrent_decodes=b, max_len=PROMPT_LEN + n + 1, prefill_buckets=(PROMPT_LEN,))
        driver = Driver(engine)
        requests = [Request(list(map(int, p)), n) for p in prompts]
        _run(driver, requests)  # compile
        with floor.profile(args.profile, f"engine_decode_b{b}"):
            _run(driver, requests)
        ours, t_ours = min((_run(driver, requests) for _ in range(args.repeats)), key=lambda r: r[1])

        tp = torch.tensor(prompts)
        kw = dict(attention_mask=torch.ones_like(tp), do_sample=False, pad_token_id=0)
        with torch.no_grad():
            hf.generate(tp, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
            t_hf = math.inf
            for _ in range(args.repeats):
                start = time.perf_counter()
                hf_out = hf.generate(tp, max_new_tokens=n, min_new_tokens=n, **kw)
                t_hf = min(t_hf, time.perf_counter() - start)
            t_hf_1 = math.inf  # prefill and one token: what the steady-state figures subtract
            for _ in range(args.repeats):
                start = time.perf_counter()
                hf.generate(tp, max_new_tokens=1, min_new_tokens=1, **kw)
                t_hf_1 = min(t_hf_1, time.perf_counter() - start)
        first = [Request(r.prompt, 1) for r in requests]
        t_ours_1 = min(_run(driver, first)[1] for _ in range(args.repeats))
        steady, hf_steady = b * (n - 1) / (t_ours - t_ours_1), b * (n - 1) / (t_hf - t_hf_1)
        results[f"decode_b{b}_steady_tokens_per_s"] = steady
        results[f"hf_decode_b{b}_steady_tokens_per_s"] = hf_steady
        results[f"decode_b{b}_steady_speedup_vs_hf"] = steady / hf_steady
        whole = floor.prefill_floor(config, b, PROMPT_LEN, ceiling) + floor.decode_floor(config, b, PROMPT_LEN, n,
                                                                                       ceiling)
        steady_floor = b * (n - 1) / floor.decode_floor(config, b, PROMPT_LEN, n, ceiling)
        results[f"decode_b{b}_floor_tokens_per_s"] = b * n / whole
        results[f"decode_b{b}_steady_floor_tokens_per_s"] = steady_floor
        results[f"decode_b{b}_over_floor"] = steady / steady_floor
        results[f"prefill_b{b}_over_floor"] = floor.prefill_floor(config, b, PROMPT_LEN, ceiling) / t_ours_1
        if b in HF_QUIET_TOKENS_PER_S:
            results[f"decode_b{b}_floor_over_hf_quiet_figure"] = b * n / whole / HF_QUIET_TOKENS_PER_S[b]
        hf_tokens = hf_out[:, PROMPT_LEN:].numpy()
        agree = np.mean([np.mean(np.array(r.tokens) == h) for r, h in zip(ours, hf_tokens)])
        results[f"decode_b{b}_tokens_per_s"] = b * n / t_ours
        results[f"hf_decode_b{b}_tokens_per_s"] = b * n / t_hf
        results[f"decode_b{b}_speedup_vs_hf"] = t_hf / t_ours
        results[f"decode_b{b}_greedy_agreement_with_hf"] = float(agree)
        if b in HF_QUIET_TOKENS_PER_S:
            results[f"decode_b{b}_speedup_vs_hf_quiet_figure"] = b * n / t_ours / HF_QUIET_TOKENS_PER_S[b]
        print(f"decode b{b}: glmjax {b * n / t_ours:8.1f} tok/s   transformers {b * n / t_hf:8.1f} tok/s   "
              f"speedup {t_hf / t_ours:.2f}x   greedy agreement {agree:.3f}   steady {steady:.1f} vs "
              f"{hf_steady:.1f} tok/s = {steady / hf_steady:.2f}x   {steady / steady_floor:.2f} of the steady floor "
              f"({steady_floor:.0f} tok/s)", flush=True)


# MTP speculation -------------------------------------------------------------------------
def bench_mtp(args, results: dict) -> None:
    cfg = presets.load_config(REPO / "configs" / "tiny.py")
    config, tc = presets.model_config_from(cfg), dict(cfg.train.to_dict(), steps=args.mtp_steps)
    corpus = train.synthetic_corpus(config.vocab_size, tc["seq_len"], tc["steps"] * tc["batch_size"] + 64, 0)
    data = train.batches(corpus.tokens[:-64], tc["batch_size"], 0)
    model = glmjax.init_model(config, seed=0)
    start = time.perf_counter()
    optimizer = train.make_optimizer(tc, model, trainable=train.TRAINABLE["sparse"])
    history = train.fit(model, optimizer, data, tc["steps"], mtp_weight=tc["mtp_loss_weight"], indexer_stage="sparse",
                        desc="train (LM + MTP)")
    metrics = train.eval_step(model, {"input_ids": jnp.asarray(corpus.tokens[-64:]),
                                      "loss_mask": jnp.ones((64, tc["seq_len"]))}, mtp_weight=0.3)
    results["mtp_train"] = {"steps": tc["steps"], "seconds": time.perf_counter() - start, "loss": history[-1],
                            "heldout_mtp_accuracy": float(metrics["mtp_accuracy"]),
                            "heldout_accuracy": float(metrics["accuracy"]), "corpus_entropy": corpus.entropy}

    # The MTP layer drafts recursively at serving time (its output hidden fed back), so it
    # is fine-tuned at every depth, per draft mode; the main model stays as trained (the
    # LM loss in train_step has no gradient on the MTP layer).
    only_mtp = nnx.All(nnx.Param, nnx.PathContains("mtp"), nnx.Not(nnx.PathContains("indexer")))
    drafters = {}
    for mode in ("own", "shared"):
        m = nnx.clone(model)
        opt = train.make_optimizer(dict(tc, steps=args.draft_steps), m, trainable=only_mtp)
        start = time.perf_counter()
        losses = [float(train.train_step(m, opt, next(data), mtp_weight=1.0, mtp_depth=args.num_draft,
                                         mtp_mode=mode)["mtp_loss"]) for _ in range(args.draft_steps)]
        results["mtp_train"][f"draft_finetune_{mode}"] = {"steps": args.draft_steps, "loss_first": losses[0],
                                                          "loss_last": losses[-1],
                                                          "seconds": time.perf_counter() - start}
        drafters[mode] = m

    args.trained_tiny = (model, corpus)  # for the quant section
    prompts = [list(map(int, row[:16])) for row in corpus.tokens[-args.mtp_prompts:]]
    max_len = 16 + args.mtp_new_tokens + 8
    requests = [Request(p, args.mtp_new_tokens) for p in prompts]

    def measure(m, num_draft, mode="own"):
        engine = GlmEngine(m, max_concurrent_decodes=1, max_len=max_len, prefill_buckets=(16,), num_draft=num_draft,
                           mtp_mode=mode)
        driver = Driver(engine)
        _run(driver, requests[:1])  # compile
        driver.stats.clear()
        times, outs = [], []
        for r in requests:  # batch 1: one request at a time
            out, t = _run(driver, [r])
            outs.append(out[0].tokens)
            times.append(t)
        steps = driver.stats["busy_slot_steps"]
        return outs, sum(len(o) for o in outs) / sum(times), driver.stats["accepted_drafts"] / steps

    plain, plain_tps, _ = measure(model, 0)
    results["mtp_plain_b1_tokens_per_s"] = plain_tps
    results["mtp_plain_rule_accuracy"] = train.rule_accuracy(corpus, np.array([p + o for p, o in zip(prompts, plain)]),
                                                             start=16)
    for mode, m in drafters.items():
        outs, tps, accepted = measure(m, args.num_draft, mode)
        key = "" if mode == "own" else "_shared"
        results[f"mtp_accept_len{key}"] = accepted
        results[f"mtp_tokens_per_step{key}"] = accepted + 1
        results[f"mtp_b1_tokens_per_s{key}"] = tps
        results[f"mtp_speedup_b1{key}"] = tps / plain_tps
        results[f"mtp_greedy_identical{key}"] = outs == plain
        print(f"mtp {mode:6s}: {accepted:.2f} of {args.num_draft} drafts accepted per step, {tps:7.1f} tok/s "
              f"vs {plain_tps:7.1f} plain = {tps / plain_tps:.2f}x, identical greedy output: {outs == plain}",
              flush=True)


def bench_mtp_main_job(args, results: dict) -> None:
    """MTP drafts of the main job's own base model (configs/sao_tiny.py: its SFT base, whose
    MTP layer trained beside the LM loss at depth 1) on its held-out prompts, sampled at the
    RL temperature: accepted drafts per step and tokens/s against the same engine without
    drafts, with every prompt in flight at once as the job serves them, and at batch 1
    (--mtp-prompts of them, one at a time)."""
    from rl import base_model
    from rl import rollout as ro
    from rl import tasks as rl_tasks

    from rl.config import JobConfig

    cfg = JobConfig.from_config(presets.load_config(REPO / "configs" / "sao_tiny.py"))
    with tempfile.TemporaryDirectory() as tmp:
        model = base_model.build_base(cfg, tmp)
        _, heldout, _ = rl_tasks.task_sets(cfg, tmp)
    heldout = heldout[:args.mtp_main_prompts]
    requests = [Request(ro.encode(t.prompt), cfg.task.max_new_tokens, temperature=float(cfg.rl.temperature), seed=i,
                        stop_ids=rl_tasks.STOP) for i, t in enumerate(heldout)]
    bucket = max(len(r.prompt) for r in requests)
    max_len = bucket + cfg.task.max_new_tokens + args.num_draft + 2

    def measure(num_draft, batch):
        """tokens/s and accepted drafts per step with `batch` slots, the requests in waves of batch."""
        engine = GlmEngine(model, max_concurrent_decodes=batch, max_len=max_len, prefill_buckets=(bucket,),
                           num_draft=num_draft)
        driver = Driver(engine)
        work = requests if batch > 1 else requests[:args.mtp_prompts]
        waves = [work[i:i + batch] for i in range(0, len(work), batch)]
        _run(driver, waves[0])  # compile
        driver.stats.clear()
        best = None
        for _ in range(args.repeats):
            outs, seconds = [], 0.0
            for wave in waves:
                out, t = _run(driver, wave)
                outs += out
                seconds += t
            tps = sum(len(o.tokens) for o in outs) / seconds
            best = tps if best is None else max(best, tps)
        return best, driver.stats["accepted_drafts"] / max(driver.stats["busy_slot_steps"], 1)

    results["mtp_main_job_workload"] = {"config": "configs/sao_tiny.py", "prompts": len(requests),
                                        "prompts_at_batch_1": min(len(requests), args.mtp_prompts),
                                        "temperature": float(cfg.rl.temperature), "num_draft": args.num_draft,
                                        "max_new_tokens": int(cfg.task.max_new_tokens)}
    for batch, key in ((len(requests), ""), (1, "_b1")):
        plain_tps, _ = measure(0, batch)
        tps, accepted = measure(args.num_draft, batch)
        results[f"mtp_accept_len_main_job{key}"] = accepted
        results[f"mtp_tokens_per_s_main_job{key}"] = tps
        results[f"mtp_plain_tokens_per_s_main_job{key}"] = plain_tps
        results[f"mtp_speedup_main_job{key}"] = tps / plain_tps
        print(f"mtp on the main job's base, batch {batch}: {accepted:.2f} of {args.num_draft} drafts accepted per "
              f"step, {tps:.0f} tok/s vs {plain_tps:.0f} plain = {tps / plain_tps:.2f}x", flush=True)


# Weight-only quantization -------------------------------------------------------------
def _decode_tokens_per_s(model, b, n, repeats) -> float:
    prompts = np.random.default_rng(0).integers(2, model.config.vocab_size, (b, PROMPT_LEN))
    driver = Driver(GlmEngine(model, max_concurrent_decodes=b, max_len=PROMPT_LEN + n + 1, prefill_buckets=(PROMPT_LEN,)))
    requests = [Request(list(map(int, p)), n) for p in prompts]
    _run(driver, requests)  # compile
    return b * n / min(_run(driver, requests)[1] for _ in range(repeats))


def bench_quant(args, results: dict) -> None:
    if not hasattr(args, "trained_tiny"):
        raise ValueError("the quant section needs the mtp section's trained model: run --only mtp,quant")
    model, corpus = args.trained_tiny
    held_out = jnp.asarray(corpus.tokens[-64:])
    ref_logits = np.asarray(model(held_out).logits)
    prompts = [list(map(int, row[:16])) for row in corpus.tokens[-args.mtp_prompts:]]

    def greedy(m):
        driver = Driver(GlmEngine(m, max_concurrent_decodes=len(prompts), max_len=16 + args.mtp_new_tokens + 1,
                                  prefill_buckets=(16,)))
        return np.array([r.tokens for r in _run(driver, [Request(p, args.mtp_new_tokens) for p in prompts])[0]])

    ref_tokens = greedy(model)
    small = glmjax.init_model(_config("small", num_nextn_predict_layers=0), seed=0)
    b = 8
    fp32 = _decode_tokens_per_s(small, b, args.new_tokens, args.repeats)
    out = {"float32": {"decode_tokens_per_s": fp32, "weight_bytes_small": quant.weight_bytes(small)}}
    for mode in ("bfloat16", "int8", "int4"):
        q = quant.quantize(model, mode)
        logits = np.asarray(q(held_out).logits)
        tokens = greedy(q)
        q_small = quant.quantize(small, mode)
        tps = _decode_tokens_per_s(q_small, b, args.new_tokens, args.repeats)
        error = quant.logit_error(ref_logits, logits)
        out[mode] = {"logit_max_abs_error": error["max_abs"], "logit_relative_rms_error": error["relative_rms"],
                     "top1_agreement": float(np.mean(logits.argmax(-1) == ref_logits.argmax(-1))),
                     "greedy_token_agreement": float(np.mean(tokens == ref_tokens)),
                     "weight_bytes_small": quant.weight_bytes(q_small),
                     "decode_tokens_per_s": tps, "decode_speedup_vs_fp32": tps / fp32}
        print(f"quant {mode}: logit rel. RMS error {error['relative_rms']:.4f}, top-1 agreement "
              f"{out[mode]['top1_agreement']:.4f}, greedy agreement {out[mode]['greedy_token_agreement']:.3f}, "
              f"decode b{b} {tps:.1f} tok/s ({tps / fp32:.2f}x fp32)", flush=True)
    results["quant_decode_batch"] = b
    results["quant"] = out


# Router utilisation ----------------------------------------------------------------------
def _utilisation(drivers, start, end) -> float:
    busy = sum(max(0.0, min(t1, end) - max(t0, start)) * n for d in drivers for t0, t1, n in d.trace)
    return busy / (sum(d.capacity for d in drivers) * (end - start))


def bench_router(args, results: dict) -> None:
    config = _config("tiny")
    model = glmjax.init_model(config, seed=0)
    rng = np.random.default_rng(1)
    lengths = np.clip(np.round(rng.lognormal(np.log(args.router_median), args.router_sigma, args.router_requests)),
                      2, 200).astype(int)
    requests = [Request(list(map(int, rng.integers(0, config.vocab_size, rng.integers(8, 25)))), int(n))
                for n in lengths]
    slots = 8
    drivers = [Driver(GlmEngine(model, max_concurrent_decodes=slots, max_len=240, prefill_buckets=(32,)),
                      record_trace=True) for _ in range(2)]
    for d in drivers:
        d.engine.warmup()  # every prefill batch size: the router admits 1, 2, 4 or 8 at a time

    def fresh():
        for d in drivers:
            d.trace.clear()

    def routed(order):
        fresh()
        for d in drivers:
            d.start()
        router = Router(drivers, order=order)
        start = time.perf_counter()
        handles = [router.submit(r) for r in requests]
        while router.queued:  # the last request has a slot: from here on the workload drains
            time.sleep(0.002)
        queue_empty = time.perf_counter()
        for h in handles:
            h.result()
        end = time.perf_counter()
        for d in drivers:
            d.stop()
        return _utilisation(drivers, start, end), end - start, _utilisation(drivers, start, queue_empty)

    fifo, fifo_seconds, fifo_queued = routed("fifo")
    results.update(router_utilization_fifo=fifo, router_seconds_fifo=fifo_seconds,
                   router_utilization_fifo_while_queued=fifo_queued)
    routed_util, routed_seconds, queued = routed("longest_budget")
    results["router_utilization_while_queued"] = queued
    results["router_order"] = "longest_budget"

    fresh()
    start = time.perf_counter()

    def static(d, share):
        for i in range(0, len(share), slots):
            _run(d, share[i:i + slots])

    threads = [threading.Thread(target=static, args=(d, requests[k::2])) for k, d in enumerate(drivers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    static_end = time.perf_counter()
    static_util = _utilisation(drivers, start, static_end)
    results.update(router_utilization=routed_util, static_utilization=static_util, router_seconds=routed_seconds,
                   static_seconds=static_end - start,
                   router_workload={"replicas": 2, "slots_each": slots, "requests": len(requests),
                                    "lognormal_median": args.router_median, "lognormal_sigma": args.router_sigma,
                                    "mean_new_tokens": float(lengths.mean()), "max_new_tokens": int(lengths.max())})
    print(f"router utilisation {routed_util:.3f} ({routed_seconds:.1f} s; FIFO {fifo:.3f}) vs static {static_util:.3f} "
          f"({static_end - start:.1f} s)", flush=True)


# Publishing weights ----------------------------------------------------------------------
def bench_publish(args, results: dict) -> None:
    results["publish_ms"] = {}
    for name in ("tiny", "small"):
        state = nnx.state(glmjax.init_model(_config(name), seed=0))
        store = WeightStore(state)
        times = []
        for v in range(1, 2001):
            t = time.perf_counter()
            store.publish(state, v)
            times.append(time.perf_counter() - t)
        size = sum(x.nbytes for x in jax.tree.leaves(state))
        results["publish_ms"][name] = {"ms": 1e3 * statistics.median(times), "param_bytes": size}
        print(f"publish {name} ({size / 2**20:.1f} MiB): {1e3 * statistics.median(times):.4f} ms", flush=True)


SECTIONS = {"decode": bench_decode, "mtp": bench_mtp, "mtp_main_job": bench_mtp_main_job, "quant": bench_quant,
            "router": bench_router, "publish": bench_publish}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--num-draft", type=int, default=5)
    parser.add_argument("--mtp-steps", type=int, default=300)
    parser.add_argument("--draft-steps", type=int, default=200, help="MTP fine-tuning steps per draft mode")
    parser.add_argument("--mtp-prompts", type=int, default=6)
    parser.add_argument("--mtp-new-tokens", type=int, default=96)
    parser.add_argument("--mtp-main-prompts", type=int, default=64, help="held-out prompts of the main job")
    parser.add_argument("--profile", default=None, help="write a JAX profiler trace of the engine's decode under DIR")
    parser.add_argument("--router-requests", type=int, default=160)
    parser.add_argument("--router-median", type=float, default=24.0)
    parser.add_argument("--router-sigma", type=float, default=0.75)
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    results = {"device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}", "machine": platform.processor(),
               "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()[0], "new_tokens": args.new_tokens,
               "num_draft": args.num_draft}
    for name in args.only.split(","):
        SECTIONS[name](args, results)
    results["load_average_at_end"] = os.getloadavg()[0]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
