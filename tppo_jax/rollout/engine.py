"""``DecodeEngine``: continuous batching over decode slots, for every caller that decodes.

Training windows (``rollout.scheduler``), the held-out eval (``eval.heldout``), the
benchmarks and ``tppo serve`` (through ``rollout.jetstream_engine``, JetStream's ``Engine``
API over this same object) all decode through this one engine, and the engine decodes only
through ``rollout.decode`` (prefill + the window loop + sampling + the RNG rule), so what is
served is what trains. It works in token ids and knows nothing of tokenizers or serving
protocols: the training path never imports a serving stack.

The cache is dense (one row per slot) or paged (a page pool; ``rollout.kv_slots`` owns page
budgets, prompt sharing and freeing): one pool, or, given a mesh, one block of slots and pages
per batch shard (what several hosts run: each host's pages serve its own slots). Cache
invariant: see ``rollout.decode`` -- a live slot has ``[0, position)`` cached and
``next_token`` pending.

Operations: per request, ``prefill`` one prompt into a ``Prefix`` and ``insert`` it into a
slot, then ``generate_step`` (one token per
live slot). Batched, for a caller that keeps a host record of each slot's tokens (the
scheduler): ``place_rows`` (a sequence enters its slot: pending token, position, response
length, sequence id), ``prefill_slots`` (prefill many rows straight into their slots),
``prefill_gathered`` (a few slots' rows gathered into a small batch: preempted rows back),
``share_prompts`` (G samples of a prompt on its pages), ``generate_window`` (the
truncated-rollout window: up to ``l`` tokens per slot in one jitted loop) and
``free_slots``. A batch of prompts from scratch: ``prefill_prompts`` and ``decode_prompts``.

The engine holds what a run fixes (the policy's graph, slots, limits, sampling, meshes and
kernels) and jits ``rollout.engine_ops``, the pure functions each operation runs on the
decode state; the state itself is ``rollout.engine_state``'s records.

The decode state is the one owner of each slot's pending token, position, response length,
liveness and ``finished`` (EOS, ``max_new_tokens`` generated, or the slot full): a caller sets
them when a sequence enters a slot and reads them back from the window's result, never
pushes them again. Sequence ids (each one seeds its sampling stream) are minted only by
``new_seq_ids``, unique over hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tppo_jax.kernels.choice import kernels_for, platform_of, traced_on
from tppo_jax.parallel.multihost import host_to_global
from tppo_jax.rollout import engine_ops as ops
from tppo_jax.rollout import kv_slots
from tppo_jax.rollout import pages as pg
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine_state import (
    DecodeState,
    EngineParams,
    PoolExhaustedError,
    Prefix,
    WindowResult,
)
from tppo_jax.rollout.paged_cache import PoolSplit

Array = jax.Array
# The columns of ``generate_step``'s ``[S, 5]`` int32 result (log-prob as float32 bits).
STEP_COLUMNS = ("token", "valid", "length", "logprob_bits", "version")
__all__ = ["DecodeEngine", "DecodeState", "EngineParams", "PoolExhaustedError", "Prefix",
           "STEP_COLUMNS", "WindowResult"]


class DecodeEngine:
    """Continuous batching over ``max_slots`` slots.

    Args:
      model: the policy ``Transformer`` (``load_params()`` with no argument decodes with it).
      eos_ids: the stop tokens (empty: every sequence runs to its budget or the slot's end).
      max_slots: concurrent sequences S (global over hosts for a dense cache on a mesh).
      max_target_length: prompt + generated positions per slot (paged: whole pages).
      max_new_tokens: a sequence is finished once it has generated this many (0: when its
        slot is full); the truncated rollout's L.
      kv_cache: ``paged`` (page_size, num_pages: 0 = every slot at full length), ``dense``, or
        ``auto`` (``kv_slots.resolve_kind``: paged on TPU/GPU, dense on CPU); no default here:
        a run's is ``rollout.kv_cache`` (the one default, in the config).
      sampling: static ``SamplingParams``; seed: the PRNG key every sampling stream derives
        from (with the sequence's ``seq_id`` and position: ``rollout.decode``).
      mesh: lay the cache out on it: a dense cache's slots over the batch axes, a paged pool
        cut into one block of slots and pages per batch shard (``paged_cache.PoolSplit``);
        ``put_rows`` places this host's per-slot rows on it.
      attn_impl: the paged decode kernel (``kernels.choice.choose_paged``; "auto": the
        Pallas kernel of the program mesh's platform, the reference on CPU).
      program_mesh: the mesh the engine's programs run on (the policy's; default ``mesh``,
        else one default device): the kernels are chosen for its platform (``kernels``) and
        run per shard on it, also when the cache itself is not laid out on it.
      reprefill_tokens: tokens per page block one ``prefill_gathered`` takes (its rows:
        ``gather_rows``): its memory and time, whatever the slot count.
    """

    def __init__(self, model: nnx.Module, *, eos_ids: Sequence[int], kv_cache: str,
                 max_slots: int = 8, max_target_length: int = 512, max_new_tokens: int = 0,
                 page_size: int = 16, num_pages: int = 0,
                 sampling: SamplingParams | None = None, seed: int = 0,
                 mesh: Mesh | None = None, attn_impl: str = "auto",
                 program_mesh: Mesh | None = None, reprefill_tokens: int = 32768) -> None:
        if kv_cache not in ("paged", "dense", "auto"):
            raise ValueError(f"kv_cache must be 'paged', 'dense' or 'auto', got {kv_cache!r}")
        kv_cache = kv_slots.resolve_kind(kv_cache)
        self.config = model.config
        self.sampling = sampling or SamplingParams()
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.kv_cache = kv_cache
        self.page_size = page_size
        if kv_cache == "paged":
            max_target_length = -(-max_target_length // page_size) * page_size
        self.max_target_length = max_target_length
        self.max_new_tokens = max_new_tokens or max_target_length
        self.num_pages = num_pages or max_slots * (max_target_length // page_size)
        self._slots, self._seed = max_slots, seed
        self.reprefill_tokens = reprefill_tokens
        self._cache_mesh = mesh
        self._mesh = mesh or Mesh(np.asarray(jax.devices()[:1]), ("data",))
        # Every program that attends is traced on the mesh it runs on: its kernels are chosen
        # for that mesh's platform and run per shard on it (``kernels.choice``), here as in
        # ``tppo plan --compile`` (abstract TPU devices) and on a TPU slice alike.
        self._program_mesh = program_mesh or self._mesh
        self.platform = platform_of(self._program_mesh)
        self.kernels = kernels_for(self.platform, self._program_mesh, model.config.attention,
                                   attn_impl)
        self._graphdef, self._init_state = nnx.split(model)
        self.version = 0
        self._next_seq = 0
        on_mesh = lambda fn: traced_on(fn, self._program_mesh)  # noqa: E731
        graph = self._graphdef
        limits = dict(max_target_length=self.max_target_length,
                      max_new_tokens=self.max_new_tokens, eos_ids=self.eos_ids,
                      sampling=self.sampling)
        self._prefill_fn = jax.jit(on_mesh(partial(ops.prefill_one, graph)))
        self._insert_fn = jax.jit(ops.insert, donate_argnums=0)
        self._prefill_slots_fn = jax.jit(on_mesh(partial(ops.prefill_slots, graph)),
                                         donate_argnums=1)
        self._prefill_gathered_fn = jax.jit(on_mesh(partial(ops.prefill_gathered, graph)),
                                            donate_argnums=1)
        self._share_rows_fn = jax.jit(ops.share_rows, donate_argnums=0)
        self._place_fn = jax.jit(ops.place, donate_argnums=0)
        self._window_fn = jax.jit(on_mesh(partial(ops.window, graph, **limits)),
                                  static_argnums=2, donate_argnums=0)
        self._step_fn = jax.jit(on_mesh(partial(ops.step, graph, **limits)), donate_argnums=0)
        self._free_fn = jax.jit(ops.free)

    # ------------------------------------------------------------------ properties
    @property
    def max_slots(self) -> int:
        return self._slots

    @property
    def mesh(self) -> Mesh:
        """The cache's mesh (one device when the engine was given none)."""
        return self._mesh

    @property
    def pages_total(self) -> int:
        return self.num_pages if self.kv_cache == "paged" else 0

    def pages_in_use(self, decode_state: DecodeState) -> int:
        """Pages with refcount > 0 (a shared prompt page counts once)."""
        return kv_slots.pages_in_use(decode_state.cache)

    @property
    def cache_mesh(self) -> Any:
        """The mesh a dense cache and the per-slot rows are laid out on (None: one device)."""
        return self._cache_mesh

    def put_rows(self, x: np.ndarray) -> Array:
        """This host's rows of a per-slot array as the device array the engine takes: global
        and batch-sharded over the engine's mesh when it has one."""
        if self._cache_mesh is None:
            return jnp.asarray(x)
        return host_to_global(x, self._cache_mesh)

    # ------------------------------------------------------------------ params / state
    def load_params(self, model: nnx.Module | Any = None, *,
                    version: int | None = None) -> EngineParams:
        """New policy weights (a module, an ``nnx.State``, or None = the initial model),
        recorded with every token they sample as ``version`` (default: one more than the
        previous call's)."""
        if model is None:
            state = self._init_state
        elif isinstance(model, nnx.Module):
            state = nnx.state(model)
        else:
            state = model
        self.version = self.version + 1 if version is None else int(version)
        return EngineParams(state=state, version=jnp.int32(self.version))

    def drop_initial_params(self) -> None:
        """Forgets the weights the engine was built with (``load_params()`` with no argument
        then fails): a long-lived engine that is always given weights pins no stale copy."""
        self._init_state = None

    def init_decode_state(self) -> DecodeState:
        """Every slot empty; the PRNG key from the engine's ``seed``."""
        s = self._slots
        cache = kv_slots.new_cache(self.config, s, self.max_target_length, kind=self.kv_cache,
                                   page_size=self.page_size, num_pages=self.num_pages,
                                   mesh=self._cache_mesh,
                                   attn_impl=self.kernels["paged_attention"],
                                   split_pages=True)
        zeros = lambda: jnp.zeros(s, jnp.int32)  # noqa: E731  (distinct buffers: donated)
        return DecodeState(cache=cache, next_token=zeros(), position=zeros(), generated=zeros(),
                           seq_id=jnp.zeros(s, jnp.uint32), live=jnp.zeros(s, bool),
                           rng=jax.random.PRNGKey(self._seed),
                           temperature=jnp.full(s, self._default_temperature(), jnp.float32),
                           top_p=jnp.full(s, self.sampling.top_p, jnp.float32))

    def _default_temperature(self) -> float:
        return 0.0 if self.sampling.greedy else self.sampling.temperature

    @property
    def next_seq(self) -> int:
        """How many sequence ids this host has minted (a checkpoint saves it)."""
        return self._next_seq

    @next_seq.setter
    def next_seq(self, n: int) -> None:
        self._next_seq = int(n)

    def new_seq_ids(self, n: int) -> np.ndarray:
        """``n`` fresh sequence ids (``[n]`` uint32), unique over hosts: each seeds one
        sequence's sampling stream, so no two sequences of a run sample alike."""
        k = self._next_seq + np.arange(n)
        self._next_seq += n
        return (k * jax.process_count() + jax.process_index()).astype(np.uint32)

    def place_rows(self, decode_state: DecodeState, rows: Array, *, next_token: Array,
                   position: Array, generated: Array, seq_id: Array) -> DecodeState:
        """Sequences enter the slots of ``rows [S]``: each one's pending token, its position
        (= tokens cached), response tokens so far and sequence id (``[S]`` each; other slots
        untouched); they are live from now on. For a new prompt or a restored sequence; its
        cache comes from ``prefill_slots`` (or a restored cache). ``decode_state`` is
        donated."""
        return self._place_fn(decode_state, rows, next_token, position, generated,
                              seq_id.astype(jnp.uint32))

    # ------------------------------------------------------------------ prefill / insert
    def prefill(self, params: EngineParams, padded_tokens: Array | np.ndarray,
                true_length: int) -> Prefix:
        """One prompt: caches ``padded_tokens[:true_length - 1]`` (``[P]``; a fixed set of
        widths P keeps the compiles few), its last token pending."""
        tokens = jnp.asarray(padded_tokens, jnp.int32)
        true_length = max(1, min(int(true_length), tokens.shape[0]))
        return self._prefill_fn(params, tokens, jnp.int32(true_length))

    def _new_seq(self, seq_id: int | None) -> Array:
        return jnp.uint32(self.new_seq_ids(1)[0] if seq_id is None else seq_id)

    def try_insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *,
                   seq_id: int | None = None, temperature: float | None = None,
                   top_p: float | None = None) -> tuple[DecodeState, bool]:
        """``insert`` that reports failure instead of raising. On failure the slot is empty
        (its previous pages freed) and no live page of another slot was touched.
        ``decode_state`` is donated: use the returned one. One pool only (a split pool is
        filled by ``prefill_slots``)."""
        if kv_slots.is_split(decode_state.cache):
            raise ValueError("insert needs one paged pool; a pool split over the mesh is "
                             "filled with prefill_slots")
        t = self._default_temperature() if temperature is None else temperature
        p = self.sampling.top_p if top_p is None else top_p
        ds, ok = self._insert_fn(decode_state, prefix, jnp.int32(slot), self._new_seq(seq_id),
                                 jnp.float32(t), jnp.float32(p))
        return ds, bool(ok)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *,
               seq_id: int | None = None, temperature: float | None = None,
               top_p: float | None = None) -> DecodeState:
        """Places a prefix into ``slot`` (freeing what it held), to sample at ``temperature``
        (0 = greedy) / ``top_p`` when the engine samples per row (default: the engine's).
        Raises ``PoolExhaustedError`` (holding the state to keep using) when the pages run
        out. ``decode_state`` is donated."""
        ds, ok = self.try_insert(prefix, decode_state, slot, seq_id=seq_id,
                                 temperature=temperature, top_p=top_p)
        if ok:
            return ds
        need = kv_slots.pages_for(int(prefix.length), self.page_size)
        raise PoolExhaustedError(
            f"KV page pool exhausted: slot {slot} needs {need} pages, "
            f"{self.num_pages - self.pages_in_use(ds)} free of {self.num_pages}", ds)

    def prefill_slots(self, params: EngineParams, decode_state: DecodeState, tokens: Array,
                      lengths: Array, rows: Array) -> tuple[DecodeState, Array]:
        """Batched prefill straight into the slots: row ``r`` of ``tokens [S, T]`` (its first
        ``lengths[r]`` tokens) becomes slot ``r``'s cache for the ``rows`` mask (new prompts,
        or continuations re-prefilled under new weights). Returns ``(state, ok [S])``; a paged
        slot that got no pages is left untouched. ``decode_state`` is donated."""
        return self._prefill_slots_fn(params, decode_state, tokens, lengths, rows)

    def prefill_gathered(self, params: EngineParams, decode_state: DecodeState, tokens: Array,
                         lengths: Array, slots: Array, rows: Array
                         ) -> tuple[DecodeState, Array]:
        """``prefill_slots`` of a few slots only (paged): row ``i`` of ``tokens [R, T]`` (its
        first ``lengths[i]`` tokens) becomes slot ``slots[i]``'s cache where ``rows [R]``
        (False: padding, nothing written); its pages, pending token and position are set
        as ``prefill_slots`` sets them. The cost scales with R, not with the slots (the
        preempted rows' re-prefill). A split pool takes whole blocks: ``R = G * R_block``,
        rows ``[g * R_block, (g+1) * R_block)`` slots of block g (``gather_rows``); arrays
        as ``put_rows`` makes them. Returns ``(state, ok [R])``. ``decode_state`` is
        donated."""
        if self.kv_cache != "paged":
            raise ValueError("prefill_gathered needs a paged cache")
        return self._prefill_gathered_fn(params, decode_state, tokens, lengths, slots, rows)

    @property
    def page_blocks(self) -> int:
        """Blocks the paged pool is split into (``kv_slots.new_cache``; 1: one pool)."""
        if self.kv_cache != "paged" or self._cache_mesh is None:
            return 1
        c = self.config
        return PoolSplit.make(self._cache_mesh, self._slots, c.num_kv_heads, c.num_heads).groups

    def gather_rows(self, width: int) -> int:
        """Rows per page block of one ``prefill_gathered`` of ``width`` columns: as many as
        ``reprefill_tokens`` tokens hold (at least one, at most the block's slots)."""
        per_block = self._slots // self.page_blocks
        return max(1, min(per_block, self.reprefill_tokens // max(int(width), 1)))

    def share_prompts(self, decode_state: DecodeState, src: Array, dst: Array,
                      seq_ids: Array) -> tuple[DecodeState, Array]:
        """Paged, one prompt per page block (``kv_slots.share_prompts``): in each block the
        ``dst [S]`` slots take the prompt of the block's ``src [S]`` slot; ``seq_ids [S]``
        uint32 their sampling streams. Per-slot arrays as ``put_rows`` makes them. Returns
        ``(state, ok [S])``. ``decode_state`` is donated."""
        return self._share_rows_fn(decode_state, src, dst, seq_ids)

    def free_slots(self, decode_state: DecodeState, slots: Sequence[int] | np.ndarray | Array
                   ) -> DecodeState:
        """Ends the sequences in ``slots`` (ids, or an ``[S]`` mask) and frees their pages."""
        if isinstance(slots, jax.Array) and slots.dtype == bool:
            return self._free_fn(decode_state, slots)  # (a global mask stays on device)
        mask = np.asarray(slots)
        if mask.dtype != bool:
            return self._free_fn(decode_state, pg.slots_to_mask(mask, self._slots))
        return self._free_fn(decode_state, jnp.asarray(mask))

    # ------------------------------------------------------------------ decode
    def generate_window(self, decode_state: DecodeState, params: EngineParams, num_steps: int,
                        budget: Array | None = None, first: Array | None = None
                        ) -> tuple[DecodeState, WindowResult]:
        """Up to ``num_steps`` tokens per live slot (``budget [S]`` caps each) in one jitted
        loop that stops early once every slot is done. Pages for the window are reserved up
        front, ``first [S]`` slots (continuations) before the others; a slot that cannot get
        them is ``stalled`` (kept, not run). ``decode_state`` is donated."""
        s = self._slots
        budget = jnp.full(s, num_steps, jnp.int32) if budget is None else budget
        first = jnp.zeros(s, bool) if first is None else first
        return self._window_fn(decode_state, params, int(num_steps), budget, first)

    def generate_step(self, params: EngineParams, decode_state: DecodeState
                      ) -> tuple[DecodeState, Array]:
        """One token for every live slot: a window of 1 through the same decode core; a slot
        that gets no page ends. Returns ``(state, [S, 5 + 2N] int32)``, columns
        ``STEP_COLUMNS`` then N top ids and N top log-probs (``SamplingParams.top_logprobs``
        with ``per_row``; else N = 0): one array, one device-to-host copy per step.
        ``decode_state`` is donated."""
        return self._step_fn(decode_state, params)

    def lowered(self, op: str, *args: Any) -> Any:
        """The jitted program of ``op`` (``prefill_slots``: ``(params, state, tokens,
        lengths, rows)``; ``prefill_gathered``: ``(params, state, tokens, lengths, slots,
        rows)``; ``generate_window``: ``(state, params, num_steps, budget,
        first)``) lowered for ``args``, abstract arrays allowed: what ``tppo_jax.compile``
        compiles ahead of time for a TPU topology."""
        fns = {"prefill_slots": self._prefill_slots_fn, "generate_window": self._window_fn,
               "prefill_gathered": self._prefill_gathered_fn}
        if op not in fns:
            raise ValueError(f"op must be one of {sorted(fns)}, got {op!r}")
        return fns[op].lower(*args)

    # ------------------------------------------------------------------ a batch of prompts
    def prefill_prompts(self, params: EngineParams, tokens: np.ndarray, lengths: np.ndarray,
                        *, seq_ids: np.ndarray | None = None, seed: int | None = None
                        ) -> tuple[DecodeState, Array]:
        """A fresh decode state with prompt row ``r`` (``tokens[r, :lengths[r]]``; this host's
        ``[S_local, T]`` rows) prefilled into slot ``r``, every slot live.

        seq_ids: each row's sampling stream (default: its row index over all hosts, not a
        minted id, so a batch samples the same whatever the engine decoded before); seed:
        the PRNG key (default: the engine's ``seed``). Returns ``(state, ok [S])``; a paged
        slot that got no pages is not live (it generates nothing)."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, np.int32)
        n, put = len(lengths), self.put_rows
        if seq_ids is None:
            seq_ids = jax.process_index() * n + np.arange(n)
        ds = self.init_decode_state()
        if seed is not None:
            ds = ds.replace(rng=jax.random.PRNGKey(seed))
        live = put(np.ones(n, bool))
        pending = tokens[np.arange(n), np.maximum(lengths - 1, 0)]
        ds = self.place_rows(ds, live, next_token=put(pending), position=put(lengths - 1),
                             generated=put(np.zeros(n, np.int32)),
                             seq_id=put(np.asarray(seq_ids, np.uint32)))
        ds, ok = self.prefill_slots(params, ds, put(tokens), put(lengths), live)
        if kv_slots.is_paged(ds.cache):
            ds = ds.replace(live=ds.live & ok)
        return ds, ok

    def decode_prompts(self, params: EngineParams, tokens: np.ndarray, lengths: np.ndarray,
                       max_new_tokens: int, *, seq_ids: np.ndarray | None = None,
                       seed: int | None = None) -> WindowResult:
        """Up to ``max_new_tokens`` for each prompt row (as ``prefill_prompts`` takes them),
        in one window from a fresh state: the result's ``tokens [S, max_new_tokens]`` and
        ``count [S]`` are each row's response (it stops at EOS)."""
        ds, _ = self.prefill_prompts(params, tokens, lengths, seq_ids=seq_ids, seed=seed)
        return self.generate_window(ds, params, max_new_tokens)[1]

