"""Token sampling for rollouts: temperature, top-k, top-p (nucleus), greedy; per-slot RNG.

Log-prob convention (docs/algorithm.md section 4: logp_old = log-prob under the sampling policy):
  logprob = log_softmax(logits / temperature)[token]
i.e. the temperature-scaled *full* softmax. Top-k / top-p truncation is NOT included, as in verl:
the trainer recomputes log_softmax(logits / temperature) for the PPO ratio, so recording the
untruncated value keeps the ratio exactly 1 on-policy. Rows sampled greedily (greedy=True or
temperature == 0) record log_softmax(logits)[token] (temperature treated as 1).

Truncation order (vLLM / HF): top-k first, then top-p on the renormalized top-k distribution.
top_k <= 0 or >= V disables top-k; top_p >= 1 disables top-p. The most likely token is always
kept, so the nucleus is never empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
ArrayOrScalar = Array | float | int | bool


def _per_row_keys(rng: Array, b: int) -> Array:
    """One key (typed () or raw (2,)) -> split into [b]; [b] keys pass through."""
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    single = rng.ndim == 0 if typed else rng.ndim == 1
    return jax.random.split(rng, b) if single else rng


def _row(x: ArrayOrScalar, b: int, dtype: jnp.dtype) -> Array:
    """Scalar or [B] -> [B] of dtype."""
    return jnp.broadcast_to(jnp.asarray(x, dtype), (b,))


def truncation_mask(
    scaled_logits: Array,
    top_p: ArrayOrScalar = 1.0,
    top_k: ArrayOrScalar = 0,
    candidates: int | None = None,
) -> tuple[Array, Array, Array]:
    """Which tokens survive top-k then top-p, in descending-logit order.

    Args:
      scaled_logits: [B, V] f32 (already divided by temperature).
      top_p: scalar or [B]; top_k: scalar or [B] int (<= 0 = off).
      candidates: static C; if set, only the C most likely tokens are considered (lax.top_k
        instead of a full sort: exact when the top-k / nucleus set fits in C tokens).
    Returns:
      order [B, C] int32 token ids by descending logit (C = V without `candidates`),
      sorted_logits [B, C], keep [B, C] bool over that order.
    """
    b, vocab = scaled_logits.shape
    top_p = _row(top_p, b, jnp.float32)
    top_k = _row(top_k, b, jnp.int32)
    if candidates is not None and candidates < vocab:
        sorted_logits, order = jax.lax.top_k(scaled_logits, candidates)
    else:
        # Stable sort of negated logits: descending, ties broken by lower token id.
        order = jnp.argsort(-scaled_logits, axis=-1, stable=True)
        sorted_logits = jnp.take_along_axis(scaled_logits, order, axis=-1)
    order = order.astype(jnp.int32)
    width = order.shape[-1]
    rank = jnp.arange(width, dtype=jnp.int32)[None, :]
    k_on = (top_k > 0) & (top_k <= width)
    keep = rank < jnp.where(k_on, top_k, width)[:, None]
    # Nucleus on the renormalized top-k distribution: keep a token if the mass strictly before
    # it is < top_p (so the token that crosses top_p is included, and rank 0 always is).
    # Without an active top-k the mass is against the full softmax, so dropping the tail
    # beyond `candidates` cannot inflate top_p.
    norm_k = jax.nn.logsumexp(jnp.where(keep, sorted_logits, -jnp.inf), -1, keepdims=True)
    norm_full = jax.nn.logsumexp(scaled_logits, axis=-1, keepdims=True)
    norm = jnp.where(k_on[:, None], norm_k, norm_full)
    probs = jnp.where(keep, jnp.exp(sorted_logits - norm), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (rank == 0)
    return order, sorted_logits, keep


def sample(
    logits: Array,
    rng: Array,
    *,
    temperature: ArrayOrScalar = 1.0,
    top_p: ArrayOrScalar | None = None,
    top_k: ArrayOrScalar | None = None,
    greedy: ArrayOrScalar = False,
    candidates: int | None = None,
) -> tuple[Array, Array]:
    """Sample one token per row.

    Args:
      logits: [B, V] (any float dtype; computed in f32).
      rng: one key (split into B) or [B] keys (e.g. from `decode.sequence_keys`).
      temperature, top_p, top_k, greedy: scalars or [B] per-slot arrays. temperature 0 or
        greedy=True -> argmax. top_p=None and top_k=None (static) skip truncation entirely,
        avoiding the [B, V] sort; top_p=1.0 / top_k=0 disable them per row at run time.
      candidates: static; restrict truncation to the C most likely tokens (see
        `truncation_mask`). Ignored when truncation is statically off. A static Python int
        top_k > 0 sets it to top_k (exact: top-k runs first), so only a top-p without a static
        top-k sorts the whole vocabulary.
    Returns:
      tokens [B] int32, logprobs [B] f32 = log_softmax(logits / temperature)[token]
      (untruncated; see module docstring).
    """
    logits = logits.astype(jnp.float32)
    b = logits.shape[0]
    temperature = _row(temperature, b, jnp.float32)
    is_greedy = _row(greedy, b, bool) | (temperature <= 0)
    # Greedy rows use temperature 1 so the division is safe and the log-prob is well defined.
    t = jnp.where(is_greedy, 1.0, temperature)
    scaled = logits / t[:, None]
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy is True:
        # Statically greedy: no [B, V] random draw or truncation at all.
        tokens = greedy_tokens
    else:
        sampled = _draw(scaled, _per_row_keys(rng, b), top_p, top_k, candidates)
        tokens = jnp.where(is_greedy, greedy_tokens, sampled)
    # log_softmax(scaled)[token] without materialising the [B, V] log-softmax; the same
    # arithmetic as jax.nn.log_softmax (shift by the max first), so the trainer's recomputed
    # log-prob matches to the last bit on-policy.
    top = jnp.max(scaled, axis=-1)
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - top
    return tokens, picked - jnp.log(jnp.sum(jnp.exp(scaled - top[:, None]), axis=-1))


def _draw(scaled: Array, keys: Array, top_p: ArrayOrScalar | None,
          top_k: ArrayOrScalar | None, candidates: int | None) -> Array:
    """[B] int32 tokens drawn from softmax(scaled) after optional top-k / top-p."""
    draw = jax.vmap(jax.random.categorical)
    if top_p is None and top_k is None:
        return draw(keys, scaled).astype(jnp.int32)
    if candidates is None and isinstance(top_k, int) and not isinstance(top_k, bool) \
            and top_k > 0:
        candidates = top_k
    order, sorted_logits, keep = truncation_mask(
        scaled, 1.0 if top_p is None else top_p, 0 if top_k is None else top_k, candidates
    )
    choice = draw(keys, jnp.where(keep, sorted_logits, -jnp.inf)).astype(jnp.int32)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def sample_per_row(
    logits: Array,
    keys: Array,
    temperature: Array,
    top_p: Array,
    *,
    top_k: int | None = None,
    n_top: int = 0,
) -> tuple[Array, Array, Array, Array]:
    """One token per row with each row's own traced temperature and top-p (a server's
    requests: one compiled program for every setting), and the log-probs of the distribution
    each row actually draws from: softmax of ``logits / temperature`` over the top-k /
    top-p survivors, renormalized.

    Args:
      logits: [B, V]; keys: [B] keys; temperature: [B] (<= 0: greedy); top_p: [B] (1: off);
      top_k: static top-k (None: off); n_top: static number of alternatives to return.
    Returns:
      tokens [B] int32, logprobs [B] f32, top_ids [B, n_top] int32 and top_logprobs
      [B, n_top] f32 (the most likely tokens of that distribution; -inf outside it).
      A greedy row takes the argmax and reports the distribution at temperature 1, top-p off.

    The draw is over the vocabulary in token order with the truncated tokens masked, so a
    row with top-p off samples the same token whether or not another row truncates (the
    [B, V] sort runs only when some row truncates).
    """
    logits = logits.astype(jnp.float32)
    b, vocab = logits.shape
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    p = jnp.where(greedy, 1.0, top_p).astype(jnp.float32)
    scaled = logits / t[:, None]

    def truncate(x: Array) -> Array:
        order, _, keep = truncation_mask(x, p, 0 if top_k is None else top_k,
                                         candidates=top_k)
        kept = jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], order].set(keep)
        return jnp.where(kept, x, -jnp.inf)

    if top_k is not None:
        masked = truncate(scaled)
    else:
        masked = jax.lax.cond(jnp.any(p < 1.0), truncate, lambda x: x, scaled)
    norm = jax.nn.logsumexp(masked, axis=-1)
    drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)
    logprobs = jnp.take_along_axis(masked, tokens[:, None], axis=-1)[:, 0] - norm
    if n_top == 0:
        return tokens, logprobs, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    top_vals, top_ids = jax.lax.top_k(masked, n_top)
    return tokens, logprobs, top_ids.astype(jnp.int32), top_vals - norm[:, None]
