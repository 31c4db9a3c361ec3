"""``HostSlots``: this host's rows of the rollout engine's slots, and the batched moves
between the host record and the engine (``rollout.scheduler`` decides what to move).

The host keeps each slot's record (``SlotState``: tokens, sampling log-probs, policy
versions); the engine's decode state keeps each slot's cache, pending token and position.
The moves: a sequence entering its slot (``_place``), a prefill over the width bucket the
rows need (``_prefill_rows``), the G samples of a prompt prefilled once (``_share_prompts``),
preempted rows back gathered into small batches (``_reprefill``), and one window or chunk of
tokens appended to the record (``_run_chunk``). With several processes each host holds
``B = B_global / P`` of the slots; every engine call here is made alike on every host (the
same shapes, as many calls), each passing its own rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tppo_jax.buckets import bucket_width
from tppo_jax.parallel.multihost import host_to_global, max_over_hosts, tree_to_host
from tppo_jax.rollout import kv_slots
from tppo_jax.rollout.engine import DecodeEngine
from tppo_jax.rollout.records import SlotState

__all__ = ["HostSlots"]


class HostSlots:
    """This host's ``B`` of ``engine``'s ``slots`` slots (over all hosts) of ``length``
    positions: ``state`` (the host record), ``ds`` (the engine's decode state), the
    weights they sample from (``set_policy``) and the counts of what moved (``stats``: the
    run's totals; ``step_stats``: this step's, host-local). ``mesh``: the rollout's mesh
    (per-slot arrays go to the engine global and batch-sharded on it; None: one device)."""

    def __init__(self, engine: DecodeEngine, *, slots: int, length: int, mesh: Any) -> None:
        self.engine = engine
        self.mesh = mesh
        self.B_global = slots
        self.B = slots // jax.process_count()  # slots this host manages
        self.ds = engine.init_decode_state()
        self.state = SlotState.empty(self.B, length)
        self.stats: dict[str, float] = {"slot_steps": 0.0, "useful_tokens": 0.0}
        # This step's host-local counts (the trainer sums them over hosts).
        self.step_stats: dict[str, float] = {}

    def set_policy(self, model: nnx.Module, version: int) -> None:
        """The weights the next windows sample from, recorded as ``version``."""
        self.model = model
        self.policy_version = version
        self.params = self.engine.load_params(model, version=version)

    def _count(self, key: str, n: float = 1.0) -> None:
        """Adds ``n`` to this step's ``key`` and to the run's total of it."""
        self.step_stats[key] = self.step_stats.get(key, 0.0) + n
        self.stats[key] = self.stats.get(key, 0.0) + n

    def _host_rows(self, tree: Any) -> Any:
        """This host's rows of the engine's ``[B_global, ...]`` outputs. An output XLA chose
        to replicate (e.g. an all-True ``ok`` of a dense cache) arrives whole: slice it."""
        lo = jax.process_index() * self.B

        def rows(x: np.ndarray) -> np.ndarray:
            if x.ndim and x.shape[0] == self.B_global != self.B:
                return x[lo:lo + self.B]
            return x

        return jax.tree.map(rows, tree_to_host(tree))

    def _put(self, x: np.ndarray) -> jax.Array:
        """Host rows -> a device array (global and batch-sharded when there is a mesh)."""
        return host_to_global(x, self.mesh) if self.mesh is not None else jnp.asarray(x)

    def _any(self, mask: np.ndarray) -> bool:
        """``mask.any()`` on some host (every host takes the same branch)."""
        return bool(max_over_hosts({"any": float(np.any(mask))})["any"])

    def _place(self, rows: np.ndarray) -> None:
        """Tells the engine which sequences entered the slots of ``rows`` (new prompts; after
        a restore, every occupied slot): the cache invariant puts the pending token at
        position ``total_len - 1``. From then on the engine advances them itself."""
        st, put = self.state, self._put
        if not rows.any() and jax.process_count() == 1:  # hosts must make the same calls
            return
        last = np.maximum(st.total_len - 1, 0)
        self.ds = self.engine.place_rows(
            self.ds, put(rows.copy()), next_token=put(st.tokens[np.arange(self.B), last]),
            position=put(last), generated=put((st.total_len - st.prompt_len).astype(np.int32)),
            seq_id=put(st.seq_id.astype(np.uint32)))

    def _prefill_rows(self, rows: np.ndarray) -> tuple[Any, jax.Array]:
        """Prefills ``rows`` over the columns they need, not the whole buffer: the longest
        selected row (over all hosts: every host must run the same shape) rounded up to a
        width bucket. New prompts of a ``keep`` run then cost ``[B, ~64]``, not ``[B, P+L]``,
        a forward pass that otherwise ran every window."""
        st = self.state
        longest = int(st.total_len[rows].max()) if rows.any() else 1
        width = bucket_width(int(max_over_hosts({"len": longest})["len"]), st.tokens.shape[1])
        return self.engine.prefill_slots(self.params, self.ds, self._put(st.tokens[:, :width]),
                                         self._put(st.total_len), self._put(rows))

    def _share_prompts(self, new_rows: np.ndarray) -> np.ndarray:
        """Paged + keep: the G samples of a prompt admitted together into one page block
        prefill it once. The first row of each such group is prefilled; the others take its
        full pages by reference (refcount) and a private copy of the partial last page, one
        group per block per call (every host makes as many calls). Returns the rows that are
        now prefilled (so the window's prefill skips them)."""
        st = self.state
        per_block = self.B // kv_slots.host_blocks(self.ds.cache)
        groups: dict[tuple[int, int], list[int]] = {}
        for r in np.flatnonzero(new_rows):
            groups.setdefault((int(st.group_id[r]), int(r) // per_block), []).append(int(r))
        by_block: dict[int, list[list[int]]] = {}
        for (_, block), rows in groups.items():
            if len(rows) > 1:
                by_block.setdefault(block, []).append(rows)
        rounds = max((len(g) for g in by_block.values()), default=0)
        rounds = int(max_over_hosts({"rounds": rounds})["rounds"])
        done = np.zeros(self.B, bool)
        if not rounds:
            return done
        src = np.zeros(self.B, bool)
        for block_groups in by_block.values():
            src[[rows[0] for rows in block_groups]] = True
        self.ds, ok = self._prefill_rows(src)
        src &= self._host_rows(ok)
        done |= src
        seq_ids = self._put(st.seq_id.astype(np.uint32))
        for i in range(rounds):
            first, dst = np.zeros(self.B, bool), np.zeros(self.B, bool)
            for block_groups in by_block.values():
                if i < len(block_groups) and src[block_groups[i][0]]:
                    first[block_groups[i][0]] = True
                    dst[block_groups[i][1:]] = True
            self.ds, ok = self.engine.share_prompts(self.ds, self._put(first), self._put(dst),
                                                    seq_ids)
            done |= dst & self._host_rows(ok)
        self._count("shared_prefills", float((done & ~src).sum()))
        return done

    def _reprefill(self, rows: np.ndarray) -> np.ndarray:
        """Preempted ``rows`` back into their own slots' pages: gathered into small batches
        of ``engine.gather_rows`` rows per page block (``DecodeEngine.prefill_gathered``),
        longest first, each batch at its longest row's width bucket (over all hosts: every
        host makes the same calls), so the cost scales with the rows, not the slots.
        Returns ``ok [B]``: the rows that got their pages."""
        st, eng = self.state, self.engine
        blocks = kv_slots.host_blocks(self.ds.cache)
        per = self.B // blocks
        lo = jax.process_index() * self.B  # this host's first slot
        queues = []
        for b in range(blocks):
            r = np.flatnonzero(rows[b * per:(b + 1) * per]) + b * per
            queues.append(list(r[np.argsort(-st.total_len[r], kind="stable")]))
        ok = np.zeros(self.B, bool)
        while True:
            longest = max((int(st.total_len[q[0]]) for q in queues if q), default=0)
            longest = int(max_over_hosts({"len": longest})["len"])
            if not longest:
                return ok
            width = bucket_width(longest, st.tokens.shape[1])
            n = eng.gather_rows(width)
            pick = np.full((blocks, n), -1, np.int64)
            for b, q in enumerate(queues):
                take, q[:] = q[:n], q[n:]
                pick[b, :len(take)] = take
            real = (pick >= 0).ravel()
            # padding rows name a slot of their block (nothing written there)
            at = np.where(pick >= 0, pick, (np.arange(blocks) * per)[:, None]).ravel()
            self.ds, got = eng.prefill_gathered(
                self.params, self.ds, self._put(st.tokens[at, :width]),
                self._put(st.total_len[at]), self._put((at + lo).astype(np.int32)),
                self._put(real))
            got = tree_to_host(got)
            if got.shape[0] != at.shape[0]:  # replicated: every host's rows
                got = got[jax.process_index() * at.shape[0]:][:at.shape[0]]
            ok[at[real]] = got[real]

    def _run_chunk(self, num_steps: int, budget: np.ndarray, new_rows: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """One ``generate_window`` of up to ``num_steps`` tokens per row (``budget``),
        continuations' pages before fresh prompts'; its tokens appended to the host record.
        Returns ``(count, finished, stalled, steps)``."""
        st = self.state
        self.ds, out = self.engine.generate_window(
            self.ds, self.params, num_steps, budget=self._put(budget.astype(np.int32)),
            first=self._put(st.live & ~new_rows))
        toks, lps, count, finished, stalled, steps = self._host_rows(
            (out.tokens, out.logprobs, out.count, out.finished, out.stalled, out.steps))
        for r in np.flatnonzero(count):
            n, a = int(count[r]), int(st.total_len[r])
            st.tokens[r, a:a + n] = toks[r, :n]
            st.sample_logprobs[r, a:a + n] = lps[r, :n]
            st.policy_version[r, a:a + n] = self.policy_version
        st.total_len += count
        return count, finished, stalled, int(steps)
