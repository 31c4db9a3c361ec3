"""A pod-scale replay of the rollout scheduler's page decisions, on a CPU, with a length oracle.

The model is replaced by an oracle that knows each sample's response length (nothing else
about decoding matters to pages); everything that decides pages is the project's own:
admission (``kv_slots.admit_rows`` with ``kv_slots.window_room``, as ``TruncatedRolloutScheduler
._admit`` calls them), the page table and pool (``rollout.pages``: ``kv_slots.reserve_pages``
and ``pages.free`` on a real ``PageState``, one per page block, as each batch shard of a split
pool runs them), continuations served before fresh prompts (``kv_slots.reserve_window``'s
order), and for the on-demand allocator the plan before each chunk (``kv_slots.plan_chunk``,
with the scheduler's candidates and ranks: ``_decode_on_demand``).

Two allocators (``rollout.page_alloc``, docs/rollout.md), side by side, for T-PPO (``l``) and
PPO (``l = L``):

- ``window``: a prompt is admitted only if its block has pages for prompt + ``l`` tokens after
  every live continuation's next window; each row reserves its whole window up front; a row
  that cannot is stalled for the window, holding its pages.
- ``demand`` (``on_demand``, the engine's default): pages taken as tokens are written,
  ``--chunk`` tokens at a time (the config's ``page_chunk``); a prompt is admitted while its
  block has the pages of its prompt free beyond ``--reserve`` (``page_reserve``) of the
  block's pages; when a block runs dry rows are preempted (pages freed) and re-prefilled,
  oldest first, in the same window when the block has room (a block with one still waiting
  admits no fresh prompt).

A window lasts as long as its busiest row (the decode loop stops when every row is done);
occupancy is response tokens decoded over slots x decode steps. ``steady``: windows whose
start still had samples queued (a finite replay's drain reported apart).

    tppo bench page-replay                    # paper config, writes results/page_replay.json + PNG
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.rollout import kv_slots
from tppo_jax.rollout import pages as pg

ASSUMED = ("response lengths are an assumption, not data: log-normal, median {median}, "
           "sigma {sigma}, clipped to [16, {L}]; every prompt {prompt} tokens; prompt pages "
           "not shared between a group's samples")


@dataclass(frozen=True)
class Pool:
    """The paged pool: ``slots`` in ``blocks`` page blocks of ``num_pages / blocks`` pages of
    ``page_size`` tokens; each slot's table holds ``max_len`` positions."""

    slots: int
    blocks: int
    page_size: int
    num_pages: int
    max_len: int

    @property
    def per_block(self) -> int:
        return self.slots // self.blocks

    @property
    def max_pages(self) -> int:
        return -(-self.max_len // self.page_size)


@dataclass
class Totals:
    windows: int = 0
    decode_steps: int = 0
    useful_tokens: int = 0
    finished: int = 0
    admitted: int = 0
    deferred: int = 0
    stalled: int = 0
    preempted: int = 0
    reprefill_tokens: int = 0
    page_steps: int = 0  # pages in use x decode steps (mean pool use)

    def summary(self, pool: Pool) -> dict:
        steps = max(self.decode_steps, 1)
        return {**self.__dict__,
                "occupancy": self.useful_tokens / (pool.slots * steps),
                "decode_steps_per_finished": self.decode_steps / max(self.finished, 1),
                "pool_use": self.page_steps / (pool.num_pages * steps)}


@dataclass
class Rows:
    """Host record of every slot (what the scheduler keeps), plus the oracle's ``left``."""

    live: np.ndarray
    preempted: np.ndarray
    position: np.ndarray  # tokens cached (prompt - 1 + generated)
    generated: np.ndarray
    left: np.ndarray  # response tokens still to come (the oracle)
    age: np.ndarray  # admission order
    done: np.ndarray = field(default=None)  # finished, slot freed after the window

    @classmethod
    def empty(cls, s: int) -> Rows:
        z = lambda dt=np.int64: np.zeros(s, dt)  # noqa: E731
        return cls(z(bool), z(bool), z(), z(), z(), z(), z(bool))


class Blocks:
    """One ``PageState`` per page block, run by the project's own page functions; each call
    also reads back the pages each slot holds and each block's free pages (one transfer)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        b, n = pool.blocks, pool.per_block
        one = pg.init(pool.num_pages // b, n, pool.max_pages, pool.page_size)
        self.state = jax.tree.map(lambda x: jnp.broadcast_to(x, (b, *x.shape)), one)
        counts = jax.vmap(lambda st: (pg.pages_held(st), pg.num_free_pages(st)))

        def reserve(st, first, rest, upto):  # continuations first (``reserve_window``)
            st, ok1 = jax.vmap(kv_slots.reserve_pages)(st, first, upto)
            st, ok2 = jax.vmap(kv_slots.reserve_pages)(st, rest, upto)
            return st, ok1 & ok2, *counts(st)

        def free(st, rows, slot_len):
            st = jax.vmap(pg.free)(st, rows)
            return st.replace(slot_len=slot_len), *counts(st)

        self._reserve, self._free = jax.jit(reserve), jax.jit(free)
        self.held = np.zeros(pool.slots, np.int64)
        self.free_pages = np.full(b, pool.num_pages // b, np.int64)

    def _b(self, x: np.ndarray) -> jax.Array:
        return jnp.asarray(x.reshape(self.pool.blocks, -1))

    def _read(self, held: jax.Array, nfree: jax.Array) -> None:
        self.held = np.asarray(held).reshape(-1).astype(np.int64)
        self.free_pages = np.asarray(nfree).astype(np.int64)

    def reserve(self, first: np.ndarray, upto: np.ndarray, rest: np.ndarray | None = None
                ) -> np.ndarray:
        """Pages for positions ``[0, upto)`` of the ``first`` rows, then of ``rest``;
        ``ok [S]`` (a row that did not fit untouched)."""
        rest = np.zeros_like(first) if rest is None else rest
        if not (first.any() or rest.any()):
            return np.ones_like(first)
        self.state, ok, held, nfree = self._reserve(self.state, self._b(first), self._b(rest),
                                                    self._b(upto.astype(np.int32)))
        self._read(held, nfree)
        return np.asarray(ok).reshape(-1)

    def free(self, rows: np.ndarray, slot_len: np.ndarray) -> None:
        """Frees ``rows``; then every slot's cached length is ``slot_len`` (the decode loop's
        writes since the last call)."""
        self.state, held, nfree = self._free(self.state, self._b(rows),
                                             self._b(slot_len.astype(np.int32)))
        self._read(held, nfree)


def cached(rows: Rows) -> np.ndarray:
    """Each slot's cached length (0 for a slot holding no pages)."""
    return np.where(rows.live & ~rows.preempted & ~rows.done, rows.position, 0)


def simulate(lengths: np.ndarray, pool: Pool, *, window: int, L: int, prompt: int,
             alloc: str, chunk: int = 256, reserve: float = 0.0, kv_policy: str = "keep"
             ) -> dict:
    """Replays ``lengths`` (response tokens per sample, queue order) through the scheduler's
    page rules (``alloc``: ``window`` or ``demand``). Returns steady / total counts."""
    ps, per, s = pool.page_size, pool.per_block, pool.slots
    blocks = Blocks(pool)
    rows = Rows.empty(s)
    steady, drain = Totals(), Totals()
    queue = np.minimum(np.asarray(lengths, np.int64), L)
    qi, age = 0, 0
    reserve_pages = int(reserve * pool.num_pages / pool.blocks)
    series, deadlocked = [], False
    while qi < len(queue) or rows.live.any():
        t = steady if qi < len(queue) else drain
        t.windows += 1
        new = np.zeros(s, bool)
        free = blocks.free_pages
        # ------------------------------------- admission (``TruncatedRolloutScheduler._admit``)
        if alloc == "demand":
            room = free - reserve_pages
            room[np.unique(np.flatnonzero(rows.preempted) // per)] = -1
            need = kv_slots.pages_for(prompt, ps)  # the prompt's cache and its first token
        else:
            room = kv_slots.window_room(free, blocks.held, rows.live, rows.position, window, ps)
            need = kv_slots.pages_for(prompt - 1 + window, ps)
        # (past the queue's end a request never fits: the replay admits nothing more)
        free_rows = np.flatnonzero(~rows.live)
        got, deferred = kv_slots.admit_rows(
            free_rows, room, per, lambda i, q=qi, k=need: k if q + i < len(queue) else 1 << 60)
        t.deferred += deferred if qi + len(got) < len(queue) else 0
        for r, _ in got:
            new[r] = True
            rows.live[r], rows.left[r] = True, queue[qi]
            rows.generated[r], rows.position[r], rows.age[r] = 0, prompt - 1, age
            qi, age = qi + 1, age + 1
        t.admitted += len(got)
        if new.any():
            ok = blocks.reserve(new, rows.position)  # the prefill
            assert ok.all(), "prefill within the admission budget failed"
        # --------------------------------------------------------------- the window
        budget = np.where(rows.live, np.minimum(window, L - rows.generated), 0)
        if alloc == "demand":
            w_steps, w_tokens = _demand_window(blocks, rows, t, budget, new, chunk, L,
                                               kv_policy == "reprefill")
        else:
            w_steps, count = _chunk(blocks, rows, t, budget, budget > 0, new, L)
            w_tokens = int(count.sum())
        if not (w_steps or new.any() or (rows.done.any())):
            deadlocked = True  # nothing ran, nothing entered or left: it never will
            break
        # the trainer releases the finished rows' slots after its update
        rows.live &= ~rows.done
        rows.done[:] = False
        series.append({"steps": w_steps, "occupancy": w_tokens / max(s * w_steps, 1),
                       "steady": t is steady})
    return {"steady": steady.summary(pool), "total": (_add(steady, drain)).summary(pool),
            "pages_in_use_at_end": int(pool.num_pages - blocks.free_pages.sum()),
            "deadlocked": deadlocked,
            "windows": series}


def _chunk(blocks: Blocks, rows: Rows, t: Totals, n: np.ndarray, want: np.ndarray,
           new: np.ndarray, L: int) -> tuple[int, int]:
    """One ``generate_window`` of up to ``n [S]`` tokens for the ``want`` rows: pages for
    them reserved first (continuations before fresh prompts; a row that does not fit stalls),
    then the oracle's tokens written, finished rows' pages freed. Returns ``(steps, tokens)``
    (``tokens``: ``[S]`` per row)."""
    pool = blocks.pool
    ok = blocks.reserve(want & ~new, rows.position + n, want & new)
    run = want & ok
    t.stalled += int((want & ~ok).sum())
    count = np.where(run, np.minimum(n, rows.left), 0)
    k = int(count.max()) if run.any() else 0
    t.decode_steps += k
    t.useful_tokens += int(count.sum())
    rows.position += count
    rows.generated += count
    rows.left -= count
    fin = run & ((rows.left == 0) | (rows.generated >= L))
    t.page_steps += k * int(pool.num_pages - blocks.free_pages.sum())
    rows.done |= fin  # the engine frees a finished row's pages in the window
    if fin.any():
        blocks.free(fin, cached(rows))
    t.finished += int(fin.sum())
    return k, count


def _demand_window(blocks: Blocks, rows: Rows, t: Totals, budget: np.ndarray, new: np.ndarray,
                   chunk: int, L: int, reprefill: bool) -> tuple[int, int]:
    """``TruncatedRolloutScheduler._decode_on_demand`` with the oracle for the model: the
    window in chunks, ``kv_slots.plan_chunk`` before each (same candidates, same ranks).
    Returns ``(decode steps, tokens)``."""
    ps = blocks.pool.page_size
    left = budget.astype(np.int64)
    current = rows.live & ~rows.preempted & (new | reprefill)
    steps = tokens = 0
    while True:
        n = np.minimum(left, chunk)
        holding = rows.live & ~rows.preempted & ~rows.done
        running = holding & (left > 0)
        tier = np.where(~running, 2, np.where(current, 1, 0))
        preempt, readmit = kv_slots.plan_chunk(
            blocks.free_pages, blocks.held, blocks.held, rows.position, n, running, holding,
            (tier << 40) + rows.age, rows.preempted & (left > 0), rows.age, ps)
        if preempt.any():
            rows.preempted |= preempt
            blocks.free(preempt, cached(rows))
            t.preempted += int(preempt.sum())
        if readmit.any():
            ok = blocks.reserve(readmit, rows.position)  # the re-prefill
            assert ok.all(), "re-prefill within the page plan failed"
            rows.preempted &= ~readmit
            current |= readmit
            t.reprefill_tokens += int(rows.position[readmit].sum())
        run = rows.live & ~rows.preempted & ~rows.done & (left > 0)
        if not run.any():
            if preempt.any():
                continue
            break
        k, count = _chunk(blocks, rows, t, np.where(run, n, 0), run, new, L)
        if not count.any():
            break
        steps, tokens = steps + k, tokens + int(count.sum())
        left -= np.minimum(count, left)
        left[rows.done] = 0
    t.stalled += int((rows.live & ~rows.done & (left > 0)).sum())
    return steps, tokens


def _add(a: Totals, b: Totals) -> Totals:
    return Totals(**{k: getattr(a, k) + getattr(b, k) for k in a.__dict__})


def config_pool(config: str, num_pages: int | None = None) -> tuple[Pool, dict]:
    """The pool of ``config``: its slots, page blocks (the decode mesh's batch shards: the
    split pool's blocks), pages and positions per slot; and its window and L."""
    from tppo_jax.config import load_config

    cfg = load_config(config)
    r, m = cfg.rollout, cfg.mesh
    chips = m.data * m.fsdp * m.tensor
    blocks = chips // m.decode_tensor if m.decode_layout == "decode" else m.data * m.fsdp
    pool = Pool(slots=r.slots, blocks=blocks, page_size=r.page_size,
                num_pages=num_pages or r.num_pages, max_len=r.max_len)
    return pool, {"window": r.window, "L": r.max_response_len, "kv_policy": r.kv_policy,
                  "chunk": r.page_chunk, "reserve": r.page_reserve}


def block_occupancy(config: str, median: float, sigma: float, prompt: int, window: int, *,
                    blocks: int = 1, batches: int = 6, chunk: int = 1024,
                    reserve: float = 0.02) -> float:
    """Steady-state occupancy of the on-demand allocator on ``blocks`` of ``config``'s page
    blocks (their slots and pages as in the full pool; a window then lasts as long as the
    busiest of these slots, not of all of them): the cost model's sensitivity table."""
    from tppo_jax.benchmarks.costs import lognormal_lengths

    pool, rc = config_pool(config)
    small = Pool(slots=pool.per_block * blocks, blocks=blocks, page_size=pool.page_size,
                 num_pages=pool.num_pages // pool.blocks * blocks, max_len=pool.max_len)
    lengths = lognormal_lengths(small.slots * batches, median, sigma, rc["L"])
    return simulate(lengths, small, window=window, L=rc["L"], prompt=prompt, alloc="demand",
                    chunk=chunk, reserve=reserve, kv_policy=rc["kv_policy"]
                    )["steady"]["occupancy"]


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.benchmarks.costs import lognormal_lengths

    pool, rc = config_pool(args.config)
    L, window = rc["L"], rc["window"]
    chunk = rc["chunk"] if args.chunk is None else args.chunk
    reserve = rc["reserve"] if args.reserve is None else args.reserve
    lengths = lognormal_lengths(pool.slots * args.batches, args.median, args.sigma, L,
                                seed=args.seed)
    full = pool.slots * pool.max_pages
    pools = {"shipped": pool.num_pages, "unlimited": full}
    for frac in args.pool_fracs:
        pools[f"{frac:g} of full"] = int(frac * full) // pool.blocks * pool.blocks
    out: dict = {"command": _command(args),
                 "assumption": ASSUMED.format(median=args.median, sigma=args.sigma, L=L,
                                              prompt=args.prompt_len),
                 "pool": {**pool.__dict__, "full_reservation_pages": full, "pools": pools},
                 "window": window, "L": L, "chunk": chunk, "reserve": reserve,
                 "kv_policy": rc["kv_policy"],
                 "samples": len(lengths), "runs": {}}
    path = Path(args.out) / "page_replay.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for method, w in (("tppo", window), ("ppo", L)):
        if method not in args.methods:
            continue
        for name, n in pools.items():
            for alloc in ("window", "demand"):
                if name == "unlimited" and alloc == "demand":
                    continue  # nothing to allocate on demand
                if name not in ("shipped", "unlimited") and alloc == "window" and not args.all:
                    continue
                key = f"{method}/{alloc}/{name}"
                t0 = time.time()
                res = simulate(lengths, Pool(**{**pool.__dict__, "num_pages": n}), window=w,
                               L=L, prompt=args.prompt_len, alloc=alloc, chunk=chunk,
                               reserve=reserve, kv_policy=rc["kv_policy"])
                res["seconds"] = time.time() - t0
                out["runs"][key] = res
                st = res["steady"]
                print(f"{key:32s} occupancy {st['occupancy']:.3f}  decode steps/finished "
                      f"{st['decode_steps_per_finished']:.2f}  preempted {st['preempted']}  "
                      f"stalled {st['stalled']}  deferred {st['deferred']}  pool use "
                      f"{st['pool_use']:.2f}  ({res['seconds']:.0f} s)", flush=True)
                path.write_text(json.dumps(out, indent=1))  # each run as it finishes
    _plot(out, path.with_suffix(".png"))
    return out


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces ``args`` (the options away from their defaults)."""
    p = argparse.ArgumentParser()
    add_args(p)
    default = vars(p.parse_args([]))
    opts = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v != default[k]]
    return " ".join(["tppo bench page-replay", *opts])


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, method in zip(axes, ("tppo", "ppo"), strict=True):
        for key, res in out["runs"].items():
            if not key.startswith(method + "/"):
                continue
            ws = [w for w in res["windows"] if w["steps"]]
            x = np.cumsum([w["steps"] for w in ws])
            ax.step(x, [w["occupancy"] for w in ws], where="post",
                    linestyle="--" if "/demand/" in key else "-",
                    label=f"{key.split('/', 1)[1]}: {res['steady']['occupancy']:.2f}")
        ax.set_title(f"{'T-PPO' if method == 'tppo' else 'PPO (l = L)'}: "
                     f"l = {out['window'] if method == 'tppo' else out['L']}")
        ax.set_xlabel("decode steps")
        ax.legend(fontsize=7, title="allocator / pool: steady occupancy", title_fontsize=7)
    axes[0].set_ylabel("slot occupancy per window")
    fig.suptitle(f"{out['pool']['slots']} slots in {out['pool']['blocks']} page blocks, "
                 f"{out['pool']['num_pages']} pages shipped; {out['assumption'][:80]}...",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/paper_qwen25_32b.yaml")
    p.add_argument("--batches", type=int, default=12, help="steps' worth of samples replayed")
    p.add_argument("--median", type=float, default=3072, help="median response tokens (assumed)")
    p.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma (assumed)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (assumed)")
    p.add_argument("--chunk", type=int, default=None,
                   help="demand: tokens decoded between two host allocations (default: the "
                        "config's rollout.page_chunk)")
    p.add_argument("--reserve", type=float, default=None,
                   help="demand: share of a block's pages admission leaves free (default: "
                        "the config's rollout.page_reserve)")
    p.add_argument("--pool-fracs", type=float, nargs="*", default=[0.08],
                   help="more pools, as shares of full reservation (demand allocator)")
    p.add_argument("--all", action="store_true", help="the window allocator on those too")
    p.add_argument("--methods", nargs="*", default=["tppo", "ppo"], choices=["tppo", "ppo"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results")
