"""benchmarks/floor.py: the FLOP and byte counts behind every `*_over_floor` figure, and the
rule that reruns a starved arm, against hand-computed values."""

import pathlib
import sys

import pytest

from tests.glmjax.test_sharding import CONFIG

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import floor  # noqa: E402


def _hand_sizes(c):
    h, k, r, v, d = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.hidden_size
    attn = (d * c.q_lora_rank + c.q_lora_rank * h * (k + r) + d * (c.kv_lora_rank + r)
            + c.kv_lora_rank * h * (k + v) + h * v * d)
    indexer = c.q_lora_rank * c.index_n_heads * c.index_head_dim + d * c.index_head_dim + d * c.index_n_heads
    dense = experts = 0
    for layer in range(c.num_hidden_layers):
        dense += attn + (indexer if c.has_indexer(layer) else 0)
        if layer < c.first_k_dense_replace:
            dense += 3 * d * c.intermediate_size
        else:
            dense += d * c.n_routed_experts + 3 * d * c.moe_intermediate_size * c.n_shared_experts
            experts += 3 * d * c.moe_intermediate_size * c.n_routed_experts
    return dense + d * c.vocab_size, experts  # + the LM head


def test_weight_sizes_and_forward_flops_match_a_hand_count():
    c = CONFIG.replace(num_nextn_predict_layers=0)
    sizes = floor.weight_sizes(c)
    dense, experts = _hand_sizes(c)
    assert (sizes["dense"], sizes["experts"], sizes["embed"]) == (dense, experts, c.vocab_size * c.hidden_size)
    rows, t = 3, 7  # fewer keys than index_topk: every layer attends densely, no indexer scoring
    assert t < c.index_topk
    f = floor.forward_flops(c, rows, t)
    per_key = 2 * c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
    assert f["attention"] == rows * c.num_hidden_layers * per_key * t * (t + 1) // 2
    assert f["matmul"] == pytest.approx(2 * rows * t * (dense + experts * c.num_experts_per_tok / c.n_routed_experts))
    head = c.hidden_size * c.vocab_size  # a prefill's LM head runs at one position per row
    assert floor.forward_flops(c, rows, t, logits=1)["matmul"] == pytest.approx(f["matmul"] - 2 * rows * (t - 1) * head)


def test_decode_bytes_count_touched_experts_and_the_cache():
    c = CONFIG.replace(num_nextn_predict_layers=0)
    dense, experts = _hand_sizes(c)
    touched = 1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** 2
    latent = (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    expected = (dense + experts * touched) * 4 + 2 * c.num_hidden_layers * latent * 5
    assert floor.decode_step_bytes(c, batch=2, context=5) == int(expected)


def test_a_starved_run_is_flagged_and_run_again():
    runs = [(1.0, 1.8), (1.05, 1.9), (2.0, 1.0)]  # the third: twice the wall, half the cores
    assert floor.starved(runs) == [False, False, True]
    kept, extra = floor.rerun_starved(runs, lambda: (1.02, 1.85))
    assert extra == 1 and kept == [(1.0, 1.8), (1.05, 1.9), (1.02, 1.85)]
    assert floor.starved([(1.0, 1.8), (1.2, 1.0)]) == [False, False]  # slower but not by 1.3x
    assert floor.seconds(2e9, 1e9, {"matmul_gflops": 1.0, "read_gb_per_s": 4.0}) == 2.0


def test_help_names_the_profile_option(monkeypatch, capsys):
    """`--help` of a benchmark run through main_with_profile shows its own options and --profile."""
    import argparse

    def main():
        parser = argparse.ArgumentParser(description="a benchmark")
        parser.add_argument("--out", required=True)
        parser.parse_args()

    monkeypatch.setattr(sys, "argv", ["bench.py", "--help"])
    with pytest.raises(SystemExit) as done:
        floor.main_with_profile(main, "bench")
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--out" in out and "--profile DIR" in out and "DIR/bench" in out


def test_cpu_primitives_fit_top_k_cost_and_read_experts_both_ways_alike():
    """cpu_primitives.py: the top-k cost line through two row lengths (hand-computed), and its
    two expert arms computing the same products as numpy."""
    import cpu_primitives
    import jax
    import numpy as np

    rows, per_key, per_row = 4, 2e-9, 50e-6
    times = {s: rows * (per_row + per_key * s) for s in (4096, 32768)}
    fit = cpu_primitives.topk_cost(times, rows)
    assert fit["ns_per_key"] == pytest.approx(2.0) and fit["us_per_row"] == pytest.approx(50.0)

    w, x = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate(((8, 16, 4), (8, 2, 16))))
    arms = cpu_primitives.expert_arms([w], x)
    expected = np.einsum("etd,edf->etf", np.asarray(x), np.asarray(w))
    for how in ("in_place", "sliced"):
        np.testing.assert_allclose(np.asarray(arms[how]()[0]), expected, rtol=1e-4, atol=1e-4)
