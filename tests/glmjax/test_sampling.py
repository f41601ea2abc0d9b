"""glmjax/sampling.py: the inverse-CDF sampler draws from exp(logp), never from a zero entry."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from glmjax.sampling import SAMPLE_BLOCK, sample, sampling_logprobs

DRAWS = 200_000


def _draw(logp: jax.Array, seed: int) -> np.ndarray:
    """DRAWS tokens per row of logp [B, N] -> [DRAWS, B]."""
    keys = jax.random.split(jax.random.key(seed), DRAWS * logp.shape[0]).reshape(DRAWS, logp.shape[0])
    return np.asarray(jax.jit(jax.vmap(lambda k: sample(k, logp)))(keys))


def test_frequencies_follow_the_probabilities():
    # a vocabulary that is not a multiple of the block, peaked and flat rows
    n = 3 * SAMPLE_BLOCK + 37
    logits = jax.random.normal(jax.random.key(0), (2, n)) * jnp.array([[3.0], [0.5]])
    logp = jax.nn.log_softmax(logits)
    tokens = _draw(logp, 1)
    for row in range(2):
        p = np.exp(np.asarray(logp[row], np.float64))
        p /= p.sum()
        counts = np.bincount(tokens[:, row], minlength=n)
        common = p * DRAWS >= 5  # chi-square on the cells with enough expected draws, the rest pooled
        observed = np.append(counts[common], counts[~common].sum())
        expected = np.append(p[common], p[~common].sum()) * DRAWS
        keep = expected > 0
        assert stats.chisquare(observed[keep], expected[keep]).pvalue > 1e-3


def test_masked_entries_are_never_drawn_and_greedy_rows_take_the_argmax():
    n = 2 * SAMPLE_BLOCK
    logits = jax.random.normal(jax.random.key(2), (3, n))
    # row 0 sampled with top-k 5; row 1 greedy (one-hot); row 2 mass only at a block's last entry
    logp = sampling_logprobs(logits, jnp.array([1.0, 0.0, 1.0]), jnp.array([5, 0, 0], jnp.int32), max_top_k=8)
    logp = logp.at[2].set(jnp.full((n,), -jnp.inf).at[SAMPLE_BLOCK - 1].set(0.0))
    tokens = _draw(logp, 3)
    top5 = set(np.argsort(-np.asarray(logits[0]))[:5].tolist())
    assert set(np.unique(tokens[:, 0]).tolist()) == top5
    assert np.all(tokens[:, 1] == int(jnp.argmax(logits[1])))
    assert np.all(tokens[:, 2] == SAMPLE_BLOCK - 1)
