"""``TPPOEngine``: JetStream's ``Engine`` API over the paged KV cache, plus an RL fast path.

Cache invariant (same as ``rollout.generate``): a live slot's pages hold positions
``[0, slot_len)``; its last token ``next_token`` (at position ``slot_len``) is not fed yet.
Each decode step feeds it, samples the following token and makes that the new pending one.
So ``prefill`` caches ``true_length - 1`` prompt tokens and every emitted token comes from
``generate`` / ``generate_window`` together with its log-prob and policy version.

Pages are taken on demand: ``insert`` reserves the prompt's pages (refusing, never
overwriting, when the pool is short), a decode step reserves a page only when a slot crosses
a page boundary, and slots that finish (EOS or ``max_target_length``) free their pages at
once. Sampling streams are per sequence: token ``n`` of the sequence with id ``seq_id`` uses
``fold_in(fold_in(rng, n), seq_id)``, so results do not depend on batch composition.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import; quiets its logging)

# isort: split
from jetstream.engine import engine_api, tokenizer_pb2

from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.rollout import pages as pg
from tppo_jax.rollout.generate import SamplingParams
from tppo_jax.rollout.paged_cache import (
    DecodeState,
    PagedKVCache,
    Prefix,
    WindowResult,
    init_pools,
)
from tppo_jax.rollout.sampling import sample

log = logging.getLogger(__name__)

Array = jax.Array
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class PoolExhaustedError(RuntimeError):
    """``insert`` found too few free pages; the decode state was left unchanged."""


@struct.dataclass
class EngineParams:
    """Model weights (``nnx.State``) + the policy version that every sampled token records."""

    state: Any
    version: Array  # () int32


@struct.dataclass
class TPPOResultTokens(engine_api.ResultTokens):
    """JetStream ``ResultTokens`` (``data [S, 5]`` int32: token, valid, length, log-prob bits,
    policy version) with two extra column ranges; the orchestrator reads only the first three."""

    logprob_idx: tuple[int, int] = struct.field(pytree_node=False, default=(3, 4))
    version_idx: tuple[int, int] = struct.field(pytree_node=False, default=(4, 5))

    def convert_to_numpy(self) -> TPPOResultTokens:
        return self.replace(data=np.asarray(self.data))

    def logprobs(self) -> np.ndarray:
        """``[S, 1]`` float32 log-prob of each slot's token (junk where not valid)."""
        col = np.asarray(self.data[:, self.logprob_idx[0]:self.logprob_idx[1]], np.int32)
        return col.view(np.float32)

    def versions(self) -> np.ndarray:
        """``[S, 1]`` int32 policy version that sampled each token."""
        return np.asarray(self.data[:, self.version_idx[0]:self.version_idx[1]])


def _row_keys(rng: Array, steps: Array, seq_id: Array) -> Array:
    """[S] keys fold_in(fold_in(rng, step_s), seq_id_s) (the ``sampling.slot_keys`` rule,
    with a per-row step = tokens the sequence already generated)."""
    one = lambda n, i: jax.random.fold_in(jax.random.fold_in(rng, n), i)  # noqa: E731
    return jax.vmap(one)(steps.astype(jnp.uint32), seq_id.astype(jnp.uint32))


class TPPOEngine(engine_api.Engine):
    """Continuous-batching engine over ``max_slots`` slots of a shared page pool.

    Args:
      model: the policy ``Transformer`` (its weights are the version-1 params).
      tokenizer: ``models.tokenizer.Tokenizer``; tokenizer_path: reported to JetStream.
      max_slots: concurrent sequences S; page_size: tokens per page.
      max_target_length: prompt + generated tokens per slot (page-table width).
      num_pages: pool size N (default: every slot at full length, i.e. no oversubscription).
      max_prefill_length: prefill bucket cap; one of JetStream's buckets (16, 32, ... 32768).
      sampling: static ``SamplingParams``; eos_id: default ``tokenizer.eos_id``.
      strict_insert: ``insert`` raises ``PoolExhaustedError`` when pages run out; False (the
        server) logs and leaves the slot empty, so JetStream ends that request with no tokens.
    """

    def __init__(self, model: nnx.Module, tokenizer: Tokenizer, *, max_slots: int = 8,
                 page_size: int = 16, max_target_length: int = 512, num_pages: int | None = None,
                 max_prefill_length: int = 128, sampling: SamplingParams | None = None,
                 eos_id: int | None = None, seed: int = 0, mesh: Mesh | None = None,
                 attn_impl: str = "auto", tokenizer_path: str = "",
                 strict_insert: bool = True) -> None:
        if max_prefill_length not in PREFILL_BUCKETS:
            raise ValueError(f"max_prefill_length must be one of {PREFILL_BUCKETS}")
        if max_prefill_length > max_target_length:
            raise ValueError("max_prefill_length must not exceed max_target_length")
        self.config = model.config
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.sampling = sampling or SamplingParams()
        self.eos_id = int(tokenizer.eos_id if eos_id is None else eos_id)
        self.page_size = page_size
        self.max_pages_per_slot = -(-max_target_length // page_size)
        self.max_target_length = self.max_pages_per_slot * page_size
        self.num_pages = num_pages or max_slots * self.max_pages_per_slot
        self.strict_insert = strict_insert
        self._slots, self._prefill_len, self._seed, self._impl = (
            max_slots, max_prefill_length, seed, attn_impl)
        self._mesh = mesh or Mesh(np.asarray(jax.devices()[:1]), ("data",))
        self._graphdef, self._init_state = nnx.split(model)
        self.version = 0
        self._next_seq = 0
        self._prefill_fn = jax.jit(self._prefill_impl)
        self._insert_fn = jax.jit(self._insert_impl)
        self._share_fn = jax.jit(self._share_impl)
        self._generate_fn = jax.jit(self._generate_impl, donate_argnums=0)
        self._window_fn = jax.jit(self._window_impl, static_argnums=2, donate_argnums=0)
        self._free_fn = jax.jit(lambda ds, m: ds.replace(pages=pg.free(ds.pages, m),
                                                         live=ds.live & ~m))

    # ------------------------------------------------------------------ Engine properties
    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._prefill_len

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    @property
    def pages_total(self) -> int:
        return self.num_pages

    def pages_in_use(self, decode_state: DecodeState) -> int:
        """Pages with refcount > 0 (a shared prompt page counts once)."""
        return self.num_pages - int(pg.num_free_pages(decode_state.pages))

    def get_prefix_destination_sharding(self) -> NamedSharding:
        return NamedSharding(self._mesh, PartitionSpec())

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> Any:
        """A ``server.JetStreamTokenizer`` over our tokenizer, stopping on ``eos_id``."""
        from tppo_jax.rollout.server import JetStreamTokenizer

        return JetStreamTokenizer(self.tokenizer, self.eos_id)

    # ------------------------------------------------------------------ params / state
    def load_params(self, model: nnx.Module | Any = None, *args: Any, **kwargs: Any
                    ) -> EngineParams:
        """New policy weights (a module, an ``nnx.State``, or None = the initial model);
        each call increments the policy version recorded with sampled tokens."""
        if model is None:
            state = self._init_state
        elif isinstance(model, nnx.Module):
            state = nnx.state(model)
        else:
            state = model
        self.version += 1
        return EngineParams(state=state, version=jnp.int32(self.version))

    def init_decode_state(self, *args: Any, **kwargs: Any) -> DecodeState:
        c, s = self.config, self._slots
        k, v = init_pools(c.num_layers, c.num_kv_heads, self.num_pages, self.page_size,
                          c.head_dim, c.jnp_dtype)
        return DecodeState(
            pages=pg.init(self.num_pages, s, self.max_pages_per_slot, self.page_size),
            k=k, v=v, next_token=jnp.zeros(s, jnp.int32), live=jnp.zeros(s, bool),
            generated=jnp.zeros(s, jnp.int32), seq_id=jnp.zeros(s, jnp.uint32),
            rng=jax.random.PRNGKey(self._seed))

    def _model(self, params: EngineParams) -> nnx.Module:
        return nnx.merge(self._graphdef, params.state)

    # ------------------------------------------------------------------ prefill / insert
    def _prefill_impl(self, params: EngineParams, tokens: Array, true_length: Array) -> Prefix:
        model = self._model(params)
        p = tokens.shape[0]
        n = jnp.clip(true_length - 1, 0, p - 1)
        pos = jnp.arange(p, dtype=jnp.int32)[None]
        _, cache = model.forward_with_cache(tokens[None].astype(jnp.int32), pos,
                                            model.init_cache(1, p), valid=pos < n)
        return Prefix(k=cache.k[:, 0], v=cache.v[:, 0], length=n,
                      next_token=tokens[n].astype(jnp.int32))

    def prefill(self, *, params: EngineParams, existing_prefix: Prefix | None = None,
                padded_tokens: Array, true_length: int) -> Prefix:
        """Caches ``padded_tokens[:true_length - 1]`` (``[P]``, P a prefill bucket)."""
        if existing_prefix is not None:
            raise NotImplementedError("TPPOEngine does not extend existing prefixes")
        tokens = jnp.asarray(padded_tokens, jnp.int32)
        true_length = max(1, min(int(true_length), tokens.shape[0]))
        return self._prefill_fn(params, tokens, jnp.int32(true_length))

    def _insert_impl(self, ds: DecodeState, prefix: Prefix, slot: Array, seq_id: Array
                     ) -> tuple[DecodeState, Array]:
        mask = jnp.arange(self._slots) == slot
        pages = pg.free(ds.pages, mask)  # JetStream reuses a slot without telling us
        pages, ok = pg.reserve(pages, mask, jnp.where(mask, prefix.length, 0))
        ok = ok[slot]
        p = prefix.k.shape[1]
        pos = jnp.arange(p, dtype=jnp.int32)[None]
        valid = (pos < prefix.length) & ok
        write = lambda kl, vl, pk, pv: pg.write_kv(kl, vl, pages, slot[None], pos, pk[None],  # noqa: E731
                                                   pv[None], valid)
        k, v = jax.vmap(write)(ds.k, ds.v, prefix.k.astype(ds.k.dtype),
                               prefix.v.astype(ds.v.dtype))
        pages = pg.advance(pages, mask & ok, prefix.length)
        at = lambda x, val: x.at[slot].set(val)  # noqa: E731
        return ds.replace(pages=pages, k=k, v=v, next_token=at(ds.next_token, prefix.next_token),
                          live=at(ds.live, ok), generated=at(ds.generated, 0),
                          seq_id=at(ds.seq_id, seq_id)), ok

    def _new_seq(self, seq_id: int | None) -> Array:
        if seq_id is None:
            seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        return jnp.uint32(seq_id)

    def try_insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *,
                   seq_id: int | None = None) -> tuple[DecodeState, bool]:
        """``insert`` that reports failure instead of raising. On failure the slot is empty
        (its previous pages freed) and no live page of another slot was touched."""
        ds, ok = self._insert_fn(decode_state, prefix, jnp.int32(slot), self._new_seq(seq_id))
        return ds, bool(ok)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *,
               seq_id: int | None = None) -> DecodeState:
        """Places a prefix into ``slot`` (freeing what it held); see ``strict_insert``."""
        ds, ok = self.try_insert(prefix, decode_state, slot, seq_id=seq_id)
        if ok:
            return ds
        need = int(pg.pages_needed(prefix.length, self.page_size))
        msg = (f"KV page pool exhausted: slot {slot} needs {need} pages, "
               f"{self.num_pages - self.pages_in_use(ds)} free of {self.num_pages}")
        if self.strict_insert:
            raise PoolExhaustedError(msg)
        log.warning("%s; request dropped", msg)
        return ds

    def _share_impl(self, ds: DecodeState, src: Array, dst: Array, seq_ids: Array
                    ) -> tuple[DecodeState, Array]:
        pages = pg.free(ds.pages, dst)
        pages, ok, tsrc, tdst = pg.share_prefix(pages, src, dst)
        k, v = jax.vmap(lambda kl, vl: pg.copy_pages(kl, vl, tsrc, tdst))(ds.k, ds.v)
        got = dst & ok
        return ds.replace(
            pages=pages, k=k, v=v, live=jnp.where(dst, got, ds.live),
            next_token=jnp.where(got, ds.next_token[src], ds.next_token),
            generated=jnp.where(got, 0, ds.generated),
            seq_id=jnp.where(got, seq_ids, ds.seq_id)), ok

    def insert_group(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]
                     ) -> tuple[DecodeState, np.ndarray]:
        """G samples of one prompt: prefix pages written once into ``slots[0]``, full pages
        shared by the others (tail page copied). Returns ``(state, ok [G] bool)``."""
        ds, ok0 = self.try_insert(prefix, decode_state, slots[0])
        if not ok0 or len(slots) == 1:
            return ds, np.array([ok0] + [False] * (len(slots) - 1))
        dst = np.zeros(self._slots, bool)
        dst[list(slots[1:])] = True
        ids = np.zeros(self._slots, np.uint32)
        ids[list(slots[1:])] = np.arange(self._next_seq, self._next_seq + len(slots) - 1)
        self._next_seq += len(slots) - 1
        ds, ok = self._share_fn(ds, jnp.int32(slots[0]), jnp.asarray(dst), jnp.asarray(ids))
        return ds, np.concatenate([[True], np.asarray(ok)[list(slots[1:])]])

    def free_slots(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Ends the sequences in ``slots`` and returns their pages to the pool."""
        return self._free_fn(decode_state, pg.slots_to_mask(jnp.asarray(slots), self._slots))

    # ------------------------------------------------------------------ decode
    def _decode_once(self, model: nnx.Module, ds: DecodeState, run: Array
                     ) -> tuple[DecodeState, Array, Array]:
        """Feeds ``next_token`` of the ``run`` rows (pages already reserved) and samples."""
        s = self._slots
        cache = PagedKVCache(ds.pages, ds.k, ds.v, jnp.arange(s, dtype=jnp.int32), self._impl)
        pos = ds.pages.slot_len
        logits, cache = model.forward_with_cache(ds.next_token[:, None], pos[:, None], cache,
                                                 valid=run[:, None])
        sp = self.sampling
        # None switches truncation off at trace time (no [S, V] sort).
        tok, lp = sample(logits[:, 0], _row_keys(ds.rng, ds.generated, ds.seq_id),
                         temperature=sp.temperature,
                         top_p=sp.top_p if sp.top_p < 1.0 else None,
                         top_k=sp.top_k if sp.top_k > 0 else None, greedy=sp.greedy)
        ds = ds.replace(pages=cache.pages, k=cache.k, v=cache.v,
                        next_token=jnp.where(run, tok, ds.next_token),
                        generated=ds.generated + run.astype(jnp.int32))
        return ds, tok, lp

    def _finish(self, ds: DecodeState, done: Array) -> DecodeState:
        """Done slots stop and give their pages back immediately."""
        return ds.replace(live=ds.live & ~done, pages=pg.free(ds.pages, done))

    def _generate_impl(self, ds: DecodeState, params: EngineParams
                       ) -> tuple[DecodeState, Array]:
        room = ds.live & (ds.pages.slot_len < self.max_target_length)
        pages, ok = pg.reserve(ds.pages, room, 1)
        run = room & ok
        ds, tok, lp = self._decode_once(self._model(params), ds.replace(pages=pages), run)
        eos = run & (tok == self.eos_id)
        # No page left (or no room): the slot ends with an invalid token, so the server closes
        # the request instead of stalling every slot behind it.
        done = eos | (ds.live & ~run) | (ds.pages.slot_len >= self.max_target_length)
        data = jnp.stack([jnp.where(run, tok, 0), run.astype(jnp.int32), ds.generated,
                          jax.lax.bitcast_convert_type(lp.astype(jnp.float32), jnp.int32),
                          jnp.broadcast_to(params.version, run.shape)], axis=1)
        return self._finish(ds, done), data

    def generate(self, params: EngineParams, decode_state: DecodeState
                 ) -> tuple[DecodeState, TPPOResultTokens]:
        """One token for every live slot. ``decode_state`` is donated (do not reuse it)."""
        ds, data = self._generate_fn(decode_state, params)
        return ds, TPPOResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                    length_idx=(2, 3), samples_per_slot=1)

    def _window_impl(self, ds: DecodeState, params: EngineParams, num_steps: int
                     ) -> tuple[DecodeState, WindowResult]:
        s, w = self._slots, num_steps
        cap = jnp.clip(self.max_target_length - ds.pages.slot_len, 0, w)
        want = ds.live & (cap > 0)
        pages, ok = pg.reserve(ds.pages, want, jnp.where(want, cap, 0))
        budget = jnp.where(want & ok, cap, 0)
        model = self._model(params)

        def cond(c):
            i, _, count, done, _, _ = c
            return (i < w) & jnp.any(~done & (count < budget))

        def body(c):
            i, d, count, done, toks, lps = c
            run = ~done & (count < budget)
            d, tok, lp = self._decode_once(model, d, run)
            idx = jnp.where(run, count, w)  # out of range -> dropped
            toks = toks.at[jnp.arange(s), idx].set(tok, mode="drop")
            lps = lps.at[jnp.arange(s), idx].set(lp, mode="drop")
            return (i + 1, d, count + run.astype(jnp.int32), done | (run & (tok == self.eos_id)),
                    toks, lps)

        init = (jnp.int32(0), ds.replace(pages=pages), jnp.zeros(s, jnp.int32),
                jnp.zeros(s, bool), jnp.zeros((s, w), jnp.int32), jnp.zeros((s, w), jnp.float32))
        steps, ds, count, eos, toks, lps = jax.lax.while_loop(cond, body, init)
        finished = ds.live & (eos | (ds.pages.slot_len >= self.max_target_length))
        stalled = want & ~ok
        return self._finish(ds, finished), WindowResult(toks, lps, count, eos, finished,
                                                        stalled, params.version, steps)

    def generate_window(self, decode_state: DecodeState, params: EngineParams, num_steps: int
                        ) -> tuple[DecodeState, WindowResult]:
        """Up to ``num_steps`` tokens per live slot in one jitted ``lax.while_loop`` (stops
        early once every slot is done). Pages for the whole window are reserved up front; a
        slot that cannot get them is ``stalled`` (kept, not run). ``decode_state`` is donated."""
        return self._window_fn(decode_state, params, int(num_steps))
