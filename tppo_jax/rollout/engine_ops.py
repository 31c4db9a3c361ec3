"""The decode engine's operations on a ``DecodeState``, as pure jax functions: what
``rollout.engine.DecodeEngine`` jits (each traced on its program mesh) and calls.

Each takes the policy's ``graphdef`` (merged with ``EngineParams.state`` inside the trace) and
``S`` slots' arrays, and returns the new state; none reads or writes anything else. Slots
are the state's ``[S]`` rows (``S = ds.live.shape[0]``, global over hosts). The decode
itself is ``rollout.decode``'s (prefill, the window loop, sampling, the RNG rule); the pages
are ``rollout.kv_slots``'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tppo_jax.rollout import kv_slots
from tppo_jax.rollout.decode import SamplingParams, decode_window, prefill
from tppo_jax.rollout.engine_state import DecodeState, EngineParams, Prefix, WindowResult

Array = jax.Array
__all__ = ["free", "insert", "place", "prefill_gathered", "prefill_one", "prefill_slots",
           "share_rows", "step", "window"]


def _last_token(tokens: Array, lengths: Array) -> Array:
    """``[R]``: each row's pending token, ``tokens[r, lengths[r] - 1]``."""
    return jnp.take_along_axis(tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]


def place(ds: DecodeState, rows: Array, next_token: Array, position: Array, generated: Array,
          seq_id: Array) -> DecodeState:
    """Sequences enter the slots of ``rows [S]`` (``DecodeEngine.place_rows``)."""
    at = lambda new, old: jnp.where(rows, new, old)  # noqa: E731
    return ds.replace(next_token=at(next_token, ds.next_token),
                      position=at(position, ds.position),
                      generated=at(generated, ds.generated), seq_id=at(seq_id, ds.seq_id),
                      live=ds.live | rows)


def free(ds: DecodeState, rows: Array) -> DecodeState:
    """The sequences of ``rows [S]`` end; their pages are freed."""
    return ds.replace(cache=kv_slots.free(ds.cache, rows), live=ds.live & ~rows)


def prefill_one(graphdef: nnx.GraphDef, params: EngineParams, tokens: Array,
                true_length: Array) -> Prefix:
    """One prompt ``tokens [P]`` into a ``Prefix`` of its first ``true_length - 1`` tokens."""
    model = nnx.merge(graphdef, params.state)
    p = tokens.shape[0]
    cache = prefill(model, model.init_cache(1, p), tokens[None].astype(jnp.int32),
                    true_length[None], jnp.ones(1, bool))
    n = jnp.clip(true_length - 1, 0, p - 1)
    return Prefix(k=cache.k[:, 0], v=cache.v[:, 0], length=n,
                  next_token=tokens[n].astype(jnp.int32))


def insert(ds: DecodeState, prefix: Prefix, slot: Array, seq_id: Array, temperature: Array,
           top_p: Array) -> tuple[DecodeState, Array]:
    """``prefix`` into ``slot`` (its previous pages freed). Returns ``(state, ok ())``."""
    mask = jnp.arange(ds.live.shape[0]) == slot
    cache = kv_slots.free(ds.cache, mask)  # a slot may be reused without a free
    cache, ok = kv_slots.reserve(cache, mask, jnp.where(mask, prefix.length, 0))
    ok = ok[slot]
    cache = kv_slots.write_prefix(cache, prefix.k, prefix.v, prefix.length, slot, ok)
    at = lambda x, val: x.at[slot].set(val)  # noqa: E731
    return ds.replace(cache=cache, next_token=at(ds.next_token, prefix.next_token),
                      position=at(ds.position, jnp.where(ok, prefix.length, 0)),
                      live=at(ds.live, ok), generated=at(ds.generated, 0),
                      seq_id=at(ds.seq_id, seq_id),
                      temperature=at(ds.temperature, temperature),
                      top_p=at(ds.top_p, top_p)), ok


def prefill_slots(graphdef: nnx.GraphDef, params: EngineParams, ds: DecodeState,
                  tokens: Array, lengths: Array, rows: Array) -> tuple[DecodeState, Array]:
    """Row ``r`` of ``tokens [S, T]`` into slot ``r``'s cache for the ``rows [S]`` mask.
    Returns ``(state, ok [S])``."""
    cache, ok = kv_slots.reserve(ds.cache, rows, jnp.where(rows, lengths - 1, 0))
    rows = rows & ok
    cache = prefill(nnx.merge(graphdef, params.state), cache, tokens, lengths, rows)
    last = _last_token(tokens, lengths)
    return ds.replace(cache=cache, next_token=jnp.where(rows, last, ds.next_token),
                      position=jnp.where(rows, lengths - 1, ds.position)), ok


def prefill_gathered(graphdef: nnx.GraphDef, params: EngineParams, ds: DecodeState,
                     tokens: Array, lengths: Array, slots: Array, rows: Array
                     ) -> tuple[DecodeState, Array]:
    """Row ``i`` of ``tokens [R, T]`` into slot ``slots[i]``'s cache where ``rows [R]``
    (paged; the prefill runs over the R rows, not the slots). Returns ``(state, ok [R])``."""
    s = ds.live.shape[0]
    at = jnp.where(rows, slots, s)  # padding rows: out of range, dropped
    mask = jnp.zeros(s, bool).at[at].set(True, mode="drop")
    upto = jnp.zeros(s, jnp.int32).at[at].set(lengths - 1, mode="drop")
    cache, ok = kv_slots.reserve(ds.cache, mask, upto)
    got = rows & ok[slots]
    view = prefill(nnx.merge(graphdef, params.state), cache.replace(slots=slots), tokens,
                   lengths, got)
    cache = view.replace(slots=cache.slots)
    last = _last_token(tokens, lengths)
    at = jnp.where(got, slots, s)
    return ds.replace(cache=cache,
                      next_token=ds.next_token.at[at].set(last, mode="drop"),
                      position=ds.position.at[at].set(lengths - 1, mode="drop")), got


def share_rows(ds: DecodeState, src: Array, dst: Array, seq_ids: Array
               ) -> tuple[DecodeState, Array]:
    """In each page block the ``dst [S]`` slots take the prompt of its ``src [S]`` slot
    (``kv_slots.share_prompts``), sampling streams ``seq_ids [S]``. Returns
    ``(state, ok [S])``."""
    cache = kv_slots.free(ds.cache, dst)
    cache, ok, src_of = kv_slots.share_prompts(cache, src, dst)
    got = dst & ok
    return ds.replace(
        cache=cache, live=jnp.where(dst, got, ds.live),
        next_token=jnp.where(got, ds.next_token[src_of], ds.next_token),
        position=jnp.where(got, ds.position[src_of], ds.position),
        generated=jnp.where(got, 0, ds.generated),
        seq_id=jnp.where(got, seq_ids, ds.seq_id),
        temperature=jnp.where(got, ds.temperature[src_of], ds.temperature),
        top_p=jnp.where(got, ds.top_p[src_of], ds.top_p)), ok


def window(graphdef: nnx.GraphDef, ds: DecodeState, params: EngineParams, num_steps: int,
           budget: Array, first: Array, *, max_target_length: int, max_new_tokens: int,
           eos_ids: tuple[int, ...], sampling: SamplingParams
           ) -> tuple[DecodeState, WindowResult]:
    """Up to ``num_steps`` tokens per live slot (``budget [S]`` caps each), its pages
    reserved up front, ``first [S]`` slots before the others; a slot is finished at EOS,
    ``max_new_tokens`` generated or ``max_target_length`` positions (its pages freed)."""
    room = jnp.clip(jnp.minimum(max_target_length - ds.position,
                                max_new_tokens - ds.generated), 0, num_steps)
    n = jnp.minimum(budget, room)
    want = ds.live & (n > 0)
    cache, ok = kv_slots.reserve_window(ds.cache, ds.position + n, want & first,
                                        want & ~first)
    n = jnp.where(want & ok, n, 0)
    out, cache = decode_window(nnx.merge(graphdef, params.state), cache, ds.next_token,
                               ds.position, ds.generated, ds.seq_id, n, ds.rng,
                               window=num_steps, eos_ids=eos_ids, params=sampling,
                               row_sampling=(ds.temperature, ds.top_p))
    last = jnp.take_along_axis(out.tokens, jnp.maximum(out.count - 1, 0)[:, None], 1)[:, 0]
    position, generated = ds.position + out.count, ds.generated + out.count
    finished = ds.live & (out.hit_eos | (position >= max_target_length)
                          | (generated >= max_new_tokens))
    ds = ds.replace(cache=kv_slots.free(cache, finished), live=ds.live & ~finished,
                    next_token=jnp.where(out.count > 0, last, ds.next_token),
                    position=position, generated=generated)
    return ds, WindowResult(out.tokens, out.logprobs, out.count, out.hit_eos, finished,
                            want & ~ok, params.version, out.steps, out.top_ids,
                            out.top_logprobs)


def step(graphdef: nnx.GraphDef, ds: DecodeState, params: EngineParams, **limits: Any
         ) -> tuple[DecodeState, Array]:
    """One token per live slot: a ``window`` of 1 (``limits``: its keywords), a slot that
    gets no page ended. Returns ``(state, [S, 5 + 2N] int32)`` (``DecodeEngine.generate_step``)."""
    s = ds.live.shape[0]
    ds, res = window(graphdef, ds, params, 1, jnp.ones(s, jnp.int32), jnp.zeros(s, bool),
                     **limits)
    # No page left: the slot ends (invalid token) so a server closes the request instead
    # of stalling every slot behind it.
    ds = free(ds, res.stalled)
    run = res.count > 0
    data = jnp.stack([res.tokens[:, 0], run.astype(jnp.int32), ds.generated,
                      jax.lax.bitcast_convert_type(res.logprobs[:, 0], jnp.int32),
                      jnp.broadcast_to(params.version, run.shape)], axis=1)
    # Per-row sampling with top_logprobs N: N ids, then N log-probs (float32 bits).
    top = [res.top_ids[:, 0], jax.lax.bitcast_convert_type(res.top_logprobs[:, 0], jnp.int32)]
    return ds, jnp.concatenate([data] + top, axis=1)
