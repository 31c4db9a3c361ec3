"""Chunked token log-probs, entropy and exact KL without materialising ``[B, T, V]`` logits.

The LM head is applied to ``chunk_size`` positions at a time inside ``lax.scan``; each chunk
body is wrapped in ``jax.checkpoint`` so the backward pass recomputes the chunk's logits
instead of storing them. Peak extra memory is ``O(B * chunk_size * V)`` in both passes.
Chunks run along the sequence axis (not over flattened B*T) so a batch sharded over devices
stays sharded inside every chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunk_stats(h: jax.Array, w: jax.Array, tgt: jax.Array, inv_temp: float):
    """``h [B, C, H]``, ``w [H, V]``, ``tgt [B, C]`` -> (logp ``[B, C]``, entropy ``[B, C]``)."""
    logits = jnp.einsum("bch,hv->bcv", h, w, preferred_element_type=jnp.float32) * inv_temp
    logp = jax.nn.log_softmax(logits, axis=-1)
    # -sum p log p on normalised log-probs; `lse - sum(p * logits)` cancels catastrophically
    # for peaked distributions.
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0], entropy


def token_logprobs(
    hidden: jax.Array,
    lm_head_weight: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = 512,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities of ``targets`` and the entropy of the softmax, chunked over T.

    Args:
      hidden: ``[B, T, H]`` final-normed hidden states (any float dtype).
      lm_head_weight: ``[H, V]`` output projection (``Transformer.lm_head_weight()``).
      targets: ``[B, T]`` int token ids whose log-prob to gather (usually tokens shifted by 1).
      chunk_size: positions per chunk; T is padded up to a multiple of it.
      temperature: logits are divided by it (sampling temperature), static.

    Returns:
      ``(logprobs [B, T], entropy [B, T])``, both float32.
    """
    b, t, h = hidden.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [B, n*C, H] -> [n, B, C, H]: scan over chunks, batch axis kept intact.
    hs = hidden.reshape(b, n, c, h).swapaxes(0, 1)
    ts = targets.astype(jnp.int32).reshape(b, n, c).swapaxes(0, 1)
    inv_temp = 1.0 / float(temperature)
    body = jax.checkpoint(lambda hc, tc: _chunk_stats(hc, lm_head_weight, tc, inv_temp))

    def step(carry, xs):
        return carry, body(*xs)

    _, (logp, ent) = jax.lax.scan(step, None, (hs, ts))
    logp = logp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return logp, ent


def naive_token_logprobs(
    hidden: jax.Array, lm_head_weight: jax.Array, targets: jax.Array, *,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Reference: full ``[B, T, V]`` logits then log_softmax (tests and benchmarks)."""
    logits = jnp.einsum("bth,hv->btv", hidden, lm_head_weight,
                        preferred_element_type=jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def _memory_report(b: int = 8, t: int = 4096, v: int = 32000, h: int = 64,
                   chunk_size: int = 512) -> None:
    """Prints compiled temp-buffer sizes of chunked vs naive (forward and forward+grad).

    Compiles only (nothing is executed), so it runs on a laptop CPU:
    ``python -m tppo_jax.kernels.logprobs``.
    """
    hid = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
    w = jax.ShapeDtypeStruct((h, v), jnp.float32)
    tgt = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(fn):
        return lambda x, y, z: jnp.sum(fn(x, y, z)[0]) + jnp.sum(fn(x, y, z)[1])

    chunked = lambda x, y, z: token_logprobs(x, y, z, chunk_size=chunk_size)
    for name, fn in (("naive", naive_token_logprobs), ("chunked", chunked)):
        for mode, f in (("fwd", fn), ("fwd+grad", jax.grad(loss(fn), argnums=(0, 1)))):
            mem = jax.jit(f).lower(hid, w, tgt).compile().memory_analysis()
            print(f"{name:8s} {mode:9s} temp={mem.temp_size_in_bytes / 2**20:10.1f} MiB  "
                  f"output={mem.output_size_in_bytes / 2**20:8.1f} MiB")


if __name__ == "__main__":
    _memory_report()
