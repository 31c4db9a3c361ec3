"""TruncatedRolloutScheduler: successive batching over B decode slots (docs/algorithm.md section 5).

Each ``step()``:
1. fills empty slots with fresh prompts, G samples per prompt (continuations never
   leave their slot, so they are "first" by construction);
2. generates at most ``window`` new tokens in every slot through the decode engine
   (``rollout.engine.DecodeEngine``: batched prefill into slots, then one jitted window);
3. reads which rows finished (EOS, or ``L`` response tokens: the K-th window full) from
   the engine, which owns each slot's decode position, pending token and liveness;
4. returns a ``RolloutBatch`` of every slot; the caller grades finished rows, trains,
   then calls ``release_finished()`` so their slots take new prompts next step.

The host keeps the record the trainer needs (every slot's tokens, sampling log-probs and
policy versions) and which slots are occupied; it tells the engine about a sequence only
when one enters a slot (``DecodeEngine.place_rows``) and reads the rest back. The moves
between the two (placing, prefilling, re-prefilling, one window's tokens into the record)
are ``rollout.host_slots.HostSlots``, the scheduler's base; the scheduler decides them.

The scheduler knows nothing about losses. With ``window >= L`` it is synchronous PPO:
every row finishes in its first window, and the slot-steps spent waiting for the
longest row are counted as idle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx, serialization

from tppo_jax.config import ConfigError, RolloutConfig
from tppo_jax.data.readers import MathExample
from tppo_jax.parallel.multihost import check_batch_layout, tree_to_host
from tppo_jax.rollout import kv_slots
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine
from tppo_jax.rollout.host_slots import HostSlots
from tppo_jax.rollout.records import RolloutBatch, SlotState

__all__ = ["MAX_IDLE_STEPS", "RolloutBatch", "SlotState", "TruncatedRolloutScheduler",
           "make_engine"]


# Steps in a row with nothing live before a run stops: one is a pool that is briefly full,
# several in a row a pool that cannot hold a single prompt.
MAX_IDLE_STEPS = 3


def make_engine(model: nnx.Module, rollout: RolloutConfig, *, eos_ids: tuple[int, ...],
                sampling: SamplingParams, seed: int = 0, mesh: Any = None,
                split_pages: bool | None = None) -> DecodeEngine:
    """The rollout's ``DecodeEngine`` for ``rollout``: ``slots`` slots of prompt + L
    positions; a dense cache laid out on ``mesh``; a paged pool off it with one process, with
    several split into one block of slots and ``num_pages / blocks`` pages per batch shard
    of ``mesh`` (each host's pages serve its own slots). Its programs run on ``mesh`` either
    way (their kernels chosen for its platform, ``kernels.choice``). ``split_pages``: split
    the paged pool whatever the process count (the compile path's slice of many hosts; None:
    several processes)."""
    r = rollout
    kind = kv_slots.resolve_kind(r.kv_cache)
    split = jax.process_count() > 1 if split_pages is None else split_pages
    on_mesh = kind == "dense" or split
    return DecodeEngine(model, eos_ids=eos_ids, max_slots=r.slots,
                        max_target_length=r.max_len,
                        max_new_tokens=r.max_response_len, kv_cache=kind,
                        page_size=r.page_size, num_pages=r.num_pages, sampling=sampling,
                        seed=seed, mesh=mesh if on_mesh else None, program_mesh=mesh)


class TruncatedRolloutScheduler(HostSlots):
    """B slots, window ``l``, max response ``L`` (``K = ceil(L / l)`` windows per sequence).

    Args:
      model: the policy (NNX ``Transformer``); replaced by ``set_policy`` after updates.
      prompts: an iterator of ``MathExample``s (the data pipeline).
      encode_prompt: ``MathExample -> list[int]`` prompt token ids.
      rollout: the run's ``rollout`` config section. Its slots B count over all hosts: with
        several processes each host owns ``B / P`` of them (its own prompts, host state,
        grading and, paged, its own blocks of the page pool) and device arrays are global.
        ``kv_policy``: ``keep`` reuses the cache computed under older weights; ``reprefill``
        recomputes every continuing row's cache under the current weights (exact).
        ``kv_cache``: ``dense`` (one ``[S]`` row per slot), ``auto``
        (``kv_slots.resolve_kind``) or ``paged`` (a pool of ``num_pages`` pages of
        ``page_size`` tokens, over all hosts; with several processes each batch shard's slots
        draw from their own ``num_pages / shards``). When the pool is short, continuations
        get their pages first and fewer fresh prompts are admitted (their slots sit idle
        this step); no live page is ever overwritten.
      eos_ids, sampling, seed: the stop tokens, how tokens are drawn, the sampling key.
      mesh: lay the KV cache out on this mesh (slots split over data/fsdp).
    """

    def __init__(self, model: nnx.Module, prompts: Iterator[MathExample],
                 encode_prompt: Callable[[MathExample], list[int]], rollout: RolloutConfig,
                 *, eos_ids: tuple[int, ...], sampling: SamplingParams, seed: int = 0,
                 mesh: Any = None) -> None:
        r = rollout
        self.prompts = prompts
        self.encode_prompt = encode_prompt
        self.G = r.group_size
        self.kv_cache = kv_slots.resolve_kind(r.kv_cache)
        if jax.process_count() > 1:
            if mesh is None:
                raise ValueError("several processes need a mesh")
            check_batch_layout(mesh, r.slots)
        self.P, self.L = r.max_prompt_len, r.max_response_len
        self.window = min(r.window, r.max_response_len)
        self.K = r.num_windows
        self.S = r.max_len
        self.kv_policy = r.kv_policy
        # Pages as tokens are written (``rollout.page_alloc``; a paged cache only).
        self.on_demand = self.kv_cache == "paged" and r.page_alloc == "on_demand"
        self.chunk, self.page_reserve = min(r.page_chunk, self.window), r.page_reserve
        super().__init__(make_engine(model, r, eos_ids=eos_ids, sampling=sampling, seed=seed,
                                     mesh=mesh), slots=r.slots, length=self.S, mesh=mesh)
        self.examples: dict[int, MathExample] = {}
        self.set_policy(model, 0)
        self.step_count = 0
        self._next_group = 0
        self._force_prefill = False
        self.pending: deque[int] = deque()
        # [B] live rows holding no cache (preempted; on demand), re-prefilled when room returns
        self.waiting = np.zeros(self.B, bool)
        self._idle_steps = 0  # steps in a row with no live row (nothing admitted or running)

    # ------------------------------------------------------------------ slot management
    def _admit(self) -> np.ndarray:
        """Fills every free slot. Each fresh prompt enqueues G sample requests; requests
        left over when slots run out wait for the next free slot (samples of a group finish
        at different windows, so free slots rarely come in multiples of G). With a paged
        cache, prompts are admitted only while the pool has pages for their first window
        after every continuation's next window, each slot from its page block's pages (a
        block that cannot take the next prompt takes none after it this step). Returns the
        rows that need a prefill."""
        st = self.state
        new_rows = np.zeros(self.B, bool)
        ids_of: dict[int, list[int]] = {}
        if self.on_demand:  # the pages free now beyond the reserve; waiting rows come first
            room = kv_slots.host_page_view(self.ds.cache)["free"]
            room = room - int(self.page_reserve * self.engine.num_pages / len(room)
                              / jax.process_count())
            room[np.unique(np.flatnonzero(self.waiting) // (self.B // len(room)))] = -1
        else:
            room = kv_slots.admission_room(self.ds.cache, st.live, st.total_len - 1,
                                           self.window)

        def need(i: int) -> int:  # pages the i-th waiting request takes (prompts drawn lazily)
            while len(self.pending) <= i:
                gid = self._next_group
                self._next_group += 1
                self.examples[gid] = next(self.prompts)
                self.pending.extend([gid] * self.G)
            gid = self.pending[i]
            if gid not in ids_of:
                ids_of[gid] = self.encode_prompt(self.examples[gid])[-self.P:]
            if not kv_slots.is_paged(self.ds.cache):
                return 0
            return kv_slots.pages_for(self._first_tokens(len(ids_of[gid])), self.engine.page_size)

        admitted, deferred = kv_slots.admit_rows(np.flatnonzero(~st.live), room,
                                                 self.B // len(room), need)
        if deferred:
            self._count("admissions_deferred", float(deferred))
        for r, _ in admitted:
            gid = self.pending.popleft()
            ids = ids_of[gid]
            st.tokens[r] = 0
            st.tokens[r, :len(ids)] = ids
            st.prompt_len[r] = st.total_len[r] = len(ids)
            st.windows_done[r] = 0
            st.live[r] = True
            st.sample_logprobs[r] = 0.0
            st.policy_version[r] = -1
            st.group_id[r] = gid
            st.seq_id[r] = self.engine.new_seq_ids(1)[0]
            new_rows[r] = True
        return new_rows

    def _first_tokens(self, prompt_len: int) -> int:
        """Positions a fresh prompt's admission takes pages for: its cache and first token
        on demand, else its cache and its whole first window."""
        return prompt_len if self.on_demand else prompt_len - 1 + self.window

    def _check_progress(self) -> None:
        """``ConfigError`` (one line) after ``MAX_IDLE_STEPS`` steps in a row with no live
        row: nothing could be admitted (a paged pool too small for a prompt and its first
        window), so the run would train on nothing."""
        self._idle_steps = 0 if self.state.live.any() else self._idle_steps + 1
        if self._idle_steps < MAX_IDLE_STEPS:
            return
        pool = ""
        if kv_slots.is_paged(self.ds.cache):
            ps = self.engine.page_size
            need = kv_slots.pages_for(self._first_tokens(self.P), ps)
            what = "its first token" if self.on_demand else "its first window"
            pool = (f": the paged KV pool ({self.engine.num_pages} pages of {ps} tokens) has "
                    f"no room for a prompt and {what} ({need} pages); raise "
                    f"rollout.num_pages (0 = enough for every slot)")
        raise ConfigError(f"rollout admitted no prompt for {MAX_IDLE_STEPS} steps in a row"
                          f"{pool}")

    def release_finished(self, finished: np.ndarray) -> None:
        """Frees the slots of finished rows (dense: rows are overwritten on reuse; paged: their
        pages go back to the pool now)."""
        finished = finished & self.state.live
        self.state.live &= ~finished
        self.waiting &= self.state.live
        if finished.any() or jax.process_count() > 1:  # hosts must make the same calls
            self.ds = self.engine.free_slots(self.ds, self._put(finished))
        live_groups = set(self.state.group_id[self.state.live].tolist()) | set(self.pending)
        self.examples = {g: e for g, e in self.examples.items() if g in live_groups}

    # ---------------------------------------------------------------------------- step
    def _prefill(self, new_rows: np.ndarray) -> None:
        """New prompts (and, with ``reprefill``, every continuation) into their slots."""
        st = self.state
        rows = ((new_rows | (self.kv_policy == "reprefill") | self._force_prefill) & st.live
                & ~self.waiting)
        self._force_prefill = False
        # Sharing needs the prompt's KV to stay fixed, so not with reprefill.
        if kv_slots.is_paged(self.ds.cache) and self.kv_policy == "keep" and self.G > 1:
            rows &= ~self._share_prompts(new_rows)
        # Tokens prefilled again for rows already decoding (reprefill, or after a restore).
        self._count("reprefill_tokens", float((st.total_len - 1)[rows & ~new_rows].sum()))
        if not rows.any() and jax.process_count() == 1:  # hosts must make the same calls
            return
        self.ds, ok = self._prefill_rows(rows)
        if not self._host_rows(ok)[rows].all():
            raise RuntimeError("KV pages ran out during a prefill the admission budget allowed")

    def step_metrics(self) -> dict[str, float]:
        """The last ``step()``'s host-local scheduler counts (the same keys on every host;
        summed over hosts they are the step's): ``admitted`` (fresh samples),
        ``admissions_deferred`` (fresh samples a short page pool turned away), ``stalled``
        (live rows that got no pages for the window, or on demand for the rest of it: kept,
        not run), ``preempted`` (rows whose pages a dry block took back, on demand),
        ``reprefill_tokens`` (tokens of rows already decoding prefilled again: ``reprefill``,
        a restore, a preempted row's return), ``decode_slot_steps`` (slots x
        decode steps), ``shared_prefills``; paged, ``pages_in_use`` (after the window: finished
        rows' pages are back) and ``pages_total``."""
        keys = ("admitted", "admissions_deferred", "stalled", "preempted", "reprefill_tokens",
                "decode_slot_steps", "shared_prefills")
        out = {k: float(self.step_stats.get(k, 0.0)) for k in keys}
        if kv_slots.is_paged(self.ds.cache):
            _, refcount = kv_slots.host_pages(self.ds.cache)
            out["pages_in_use"] = float((refcount > 0).sum())
            out["pages_total"] = float(refcount.shape[0])
        return out

    def step(self) -> RolloutBatch:
        st = self.state
        self.step_stats = {}
        new_rows = self._admit()
        self._count("admitted", float(new_rows.sum()))
        self._check_progress()
        self._place(new_rows)
        self._prefill(new_rows)
        budget = np.where(st.live, np.minimum(self.window, st.prompt_len + self.L - st.total_len),
                          0).astype(np.int32)
        window_start, window_index = st.total_len.copy(), st.windows_done.copy()
        decode = self._decode_on_demand if self.on_demand else self._decode_window
        finished, steps = decode(budget, new_rows)
        count = st.total_len - window_start
        st.windows_done += st.live & (count > 0)
        self.step_count += 1
        self.stats["slot_steps"] += float(self.B * steps)
        self.stats["useful_tokens"] += float(count.sum())
        self.step_stats["decode_slot_steps"] = float(self.B * steps)
        return RolloutBatch(
            tokens=st.tokens.copy(), prompt_len=st.prompt_len.copy(),
            window_start=window_start, window_len=count.astype(np.int32),
            finished=finished, window_index=window_index,
            sample_logprobs=st.sample_logprobs.copy(), policy_version=st.policy_version.copy(),
            group_id=st.group_id.copy(),
            examples=[self.examples.get(int(g)) if live else None
                      for g, live in zip(st.group_id, st.live, strict=True)],
        )

    def _decode_window(self, budget: np.ndarray, new_rows: np.ndarray) -> tuple[np.ndarray, int]:
        """Whole-window reservation (``rollout.page_alloc: window``, and a dense cache): one
        window, each row's pages for all of it taken up front; a row that cannot get them
        stalls (kept, not run). Returns ``(finished, decode steps)``."""
        _, finished, stalled, steps = self._run_chunk(self.window, budget, new_rows)
        self._count("stalled", float((self.state.live & stalled).sum()))
        return finished, steps

    def _decode_on_demand(self, budget: np.ndarray, new_rows: np.ndarray
                          ) -> tuple[np.ndarray, int]:
        """Pages taken as tokens are written: the window in chunks of ``page_chunk`` tokens,
        the pages each chunk crosses allocated before it (``kv_slots.plan_chunk``). A block
        that runs dry preempts its youngest rows whose whole cache the current weights
        computed (fresh prompts, rows re-prefilled this window; with ``reprefill`` every
        row): their pages are freed and they are re-prefilled, oldest first, when the block
        has room again, in this window and under these weights, so their tokens and log-probs
        are the ones they would have had (sampling is keyed by sequence and position, not by
        loop step). Rows done with this window give way first, to the running rows and to
        the preempted ones (they are idle until the next window, re-prefilled at its start);
        with ``keep``, such a row, or a running one of an older cache when nothing else is
        left, continues from a cache of the current weights, as ``reprefill`` gives every row
        (the one way in which ``keep``'s samples depend on the pool). Returns ``(finished,
        decode steps)``."""
        st, left = self.state, budget.astype(np.int64)
        finished, steps = np.zeros(self.B, bool), 0
        reprefill = self.kv_policy == "reprefill"
        current = st.live & ~self.waiting & (new_rows | reprefill)
        while True:
            view = kv_slots.host_page_view(self.ds.cache)
            n = np.minimum(left, self.chunk)
            holding = st.live & ~self.waiting & ~finished
            running = holding & (left > 0)
            # Preempted first: rows done with this window (idle until the next one; with
            # reprefill re-prefilled then anyway), then rows of the current weights, then
            # the rest of keep's.
            tier = np.where(~running, 2, np.where(current, 1, 0))
            age = st.seq_id.astype(np.int64)
            preempt, readmit = kv_slots.plan_chunk(
                view["free"], view["held"], view["private"], st.total_len - 1, n, running,
                holding, (tier << 40) + age, self.waiting & (left > 0), age,
                self.engine.page_size)
            preempted = self._any(preempt)
            if preempted:
                self.ds = self.engine.free_slots(self.ds, self._put(preempt))
                self.waiting |= preempt
                self._count("preempted", float(preempt.sum()))
            if self._any(readmit):
                self._place(readmit)
                if not self._reprefill(readmit)[readmit].all():
                    raise RuntimeError("KV pages ran out during a re-prefill the page plan "
                                       "allowed")
                self.waiting &= ~readmit
                current |= readmit
                self._count("reprefill_tokens", float((st.total_len - 1)[readmit].sum()))
            run = st.live & ~self.waiting & (left > 0)
            if not self._any(run):
                if preempted:  # (pages shared with a row preempted before come back now)
                    continue
                break
            count, fin, _, k = self._run_chunk(self.chunk, np.where(run, n, 0), new_rows)
            if not self._any(count):
                break  # every block full of rows this window cannot preempt
            left -= count
            left[fin] = 0
            finished |= fin
            steps += k
        self._count("stalled", float((st.live & ~finished & (left > 0)).sum()))
        return finished, steps

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"slots": self.state.to_dict(), "step_count": self.step_count,
                "next_seq": self.engine.next_seq, "next_group": self._next_group,
                "pending": list(self.pending),
                "examples": {str(g): e.__dict__ for g, e in self.examples.items()},
                "policy_version": self.policy_version}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.state = SlotState(**{k: np.asarray(v) for k, v in d["slots"].items()})
        self.step_count = int(d["step_count"])
        self.engine.next_seq, self._next_group = int(d["next_seq"]), int(d["next_group"])
        self.pending = deque(int(g) for g in d["pending"])
        self.examples = {int(g): MathExample(**e) for g, e in d["examples"].items()}
        # (a checkpoint from before the group baseline's ``so_far`` was removed also holds
        # "outcomes": nothing reads them)
        self.policy_version = int(d["policy_version"])
        # Without a saved cache every live row is re-prefilled (see ``restore_cache``): on
        # demand as preempted rows are (oldest first, as pages allow), else before the window.
        self.ds = self.engine.init_decode_state()
        self.waiting = self.state.live.copy() if self.on_demand else np.zeros(self.B, bool)
        self._place(self.state.live & ~self.waiting)
        self._force_prefill = not self.on_demand

    def cache_state(self) -> dict[str, Any]:
        """The KV cache (dense or paged, with its page table) as a nested dict of arrays."""
        return serialization.to_state_dict(self.ds.cache)

    def restore_cache(self, tree: dict[str, Any]) -> None:
        """Restores a ``cache_state()`` so continuations resume exactly as in an
        uninterrupted run (no re-prefill); arrays keep the live cache's placement."""
        placed = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding),
                              tree, serialization.to_state_dict(self.ds.cache))
        self.ds = self.ds.replace(cache=serialization.from_state_dict(self.ds.cache, placed))
        self._force_prefill = False
        if self.on_demand:  # rows saved preempted (no cache) stay so; the rest decode on
            cached = kv_slots.host_page_view(self.ds.cache)["cached"]
            st = self.state
            self.waiting = st.live & (cached != st.total_len - 1)
            self._place(st.live & ~self.waiting)

    def checkpoint_items(self) -> dict[str, Any]:
        """The device trees a checkpoint saves: ``slots`` (every host's slot rows as one
        global array each) and ``kv_cache``; also the templates a restore reads into."""
        return {"slots": {k: self._put(v) for k, v in self.state.to_dict().items()},
                "kv_cache": self.cache_state()}

    def host_state(self) -> dict[str, Any]:
        """This host's JSON-able state besides the slots (counters, queue, examples)."""
        return {k: v for k, v in self.state_dict().items() if k != "slots"}

    def restore(self, trees: dict[str, Any], host_state: dict[str, Any]) -> None:
        """Undoes ``checkpoint_items()`` + ``host_state()``: the next ``step()`` continues
        as the saved scheduler would have. Set the policy (``set_policy``) before stepping."""
        self.load_state_dict({**host_state, "slots": tree_to_host(trees["slots"])})
        self.restore_cache(trees["kv_cache"])
