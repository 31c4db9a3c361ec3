"""One step's rollout and what the learner trains on: a window over every decode slot,
grading of the rows that finished (outcome rewards, DAPO overlong shaping), then the
rollout as the learner's input: a ``TrainBatch`` of device arrays (columns cut to a width
bucket, rows global over hosts) and the ``RowPlan`` the updates' plans read (row lengths,
finished rows, each epoch's order).

Shared by the training loop and value pretraining (``trainer/value_pretrain.py``), which
collects full-length rollouts from its own scheduler; ``learn_from`` is the one sequence that
turns a rollout into a ``Learner.step`` for both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.buckets import CompileWatch, bucket_width
from tppo_jax.config import Config
from tppo_jax.learner import Learner, RowPlan, StepStats, Targets, TrainBatch, TrainState
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.parallel import multihost as mh
from tppo_jax.rewards.grader import MathGrader, overlong_penalty
from tppo_jax.rollout.scheduler import RolloutBatch, TruncatedRolloutScheduler


@dataclass
class Rollout:
    """One step's rollout and its grades (this host's rows)."""

    rb: RolloutBatch
    fin: np.ndarray  # indices of the finished rows
    reward: np.ndarray  # [B] outcome reward (+ overlong shaping) of finished rows, else 0
    correct: np.ndarray  # [B] bool
    counts: dict[str, int]  # grade outcomes by reason
    samples: list[dict[str, Any]]  # readable records of the first finished rows
    idle: int  # slots left empty (paged pool short)
    t0: float  # when the step began
    t_roll: float  # seconds in the rollout, compiles included
    t_grade: float
    n_roll: int  # rollout-side compiles (decode shapes) and their seconds
    c_roll: float


def collect(sched: TruncatedRolloutScheduler, tok: Tokenizer, grader: MathGrader, cfg: Config,
            watch: CompileWatch) -> Rollout:
    """One rollout window over every slot of ``sched``, then grading of the rows that
    finished (``watch``: the compiles it caused, counted apart)."""
    t0 = time.time()
    rb = sched.step()
    idle = int((~sched.state.live).sum())
    t_roll = time.time() - t0
    fin = np.flatnonzero(rb.finished)
    reward = np.zeros(sched.B, np.float32)  # this host's rows
    correct = np.zeros(sched.B, bool)
    counts: dict[str, int] = {}
    samples: list[dict[str, Any]] = []
    if len(fin):
        texts = [tok.decode(rb.response_tokens(i)) for i in fin]
        g = grader.grade(texts, [rb.examples[i].answer for i in fin],
                             [rb.examples[i] for i in fin])
        reward[fin], correct[fin], counts = g.rewards, g.correct, g.counts
        if cfg.reward.shuffle_control:  # no signal: who got which grade is random
            reward, correct = shuffle_grades(
                reward, correct, fin, np.random.default_rng([cfg.train.seed, sched.step_count]))
        if cfg.reward.overlong_buffer > 0:  # DAPO soft overlong punishment
            reward[fin] += overlong_penalty(
                (rb.total_len - rb.prompt_len)[fin], cfg.rollout.max_response_len,
                cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
        samples = sample_rows(tok, rb, fin, texts, reward, g.reasons,
                              cfg.logging.samples_per_step, g.notes)
    t_grade = time.time() - t0 - t_roll
    n_roll, c_roll = watch.take()
    return Rollout(rb, fin, reward, correct, counts, samples, idle, t0, t_roll, t_grade,
                   n_roll, c_roll)


def shuffle_grades(reward: np.ndarray, correct: np.ndarray, fin: np.ndarray,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``reward [B]`` and ``correct [B]`` with the finished rows' (``fin``) grades permuted
    among them, together (the shuffled-reward control: same grades, no signal)."""
    perm = rng.permutation(fin)
    reward, correct = reward.copy(), correct.copy()
    reward[fin], correct[fin] = reward[perm], correct[perm]
    return reward, correct


def sample_rows(tok: Tokenizer, rb: RolloutBatch, rows: np.ndarray, texts: list[str],
                reward: np.ndarray, reasons: list[str], n: int,
                notes: list[str | None] | None = None) -> list[dict[str, Any]]:
    """The first ``n`` finished rows as readable records (prompt, completion, grade; with a
    ``reward.fn``, ``note``: the reason it returned, or why it failed)."""
    out = []
    for j, i in enumerate(rows[:n]):
        prompt = tok.decode(rb.tokens[i, :int(rb.prompt_len[i])], skip_special=False)
        out.append({"prompt": prompt, "completion": texts[j], "answer": rb.examples[i].answer,
                    "reward": float(reward[i]), "reason": reasons[j]})
        if notes and notes[j] is not None:
            out[-1]["note"] = notes[j]
    return out


def train_batch(rb: RolloutBatch, reward: np.ndarray, correct: np.ndarray, mesh
                ) -> TrainBatch:
    """The rollout as device arrays, split over the mesh's batch axes (global arrays of
    every host's rows when there are several processes), prompt ids included.

    Columns are cut to the longest row (over all hosts) rounded up to a width bucket
    (``buckets.bucket_width``): the updates then cost what the batch needs, not the full
    buffer, and only a handful of widths ever compile (the updates then cut each row group
    to its own bucket, see ``learner/plan.py``).
    """
    longest = mh.max_over_hosts({"len": int(rb.total_len.max())})["len"]
    width = bucket_width(int(longest), rb.tokens.shape[1])
    g = lambda x: mh.host_to_global(x, mesh)  # noqa: E731
    return TrainBatch(
        tokens=g(rb.tokens[:, :width]), attn=g(np.arange(width)[None] < rb.total_len[:, None]),
        sample_logprobs=g(rb.sample_logprobs[:, :width]), prompt_len=g(rb.prompt_len),
        window_start=g(rb.window_start), window_len=g(rb.window_len),
        finished=g(rb.finished), reward=g(reward.astype(np.float32)),
        correct=g(correct.astype(bool)),
        group=g(global_group_ids(rb.group_id, jax.process_index(), jax.process_count())))


def global_group_ids(group_id: np.ndarray, host: int, hosts: int) -> np.ndarray:
    """``[B]`` int32 prompt ids unique over hosts: each host's scheduler counts its groups
    from 0, so host 1's group 5 is not host 0's group 5 (ids wrap at 2**31 / hosts)."""
    local = group_id.astype(np.int64) % ((1 << 31) // hosts)
    return (local * hosts + host).astype(np.int32)


def row_plan(rb: RolloutBatch, shuffle: np.ndarray) -> RowPlan:
    """This rollout's ``RowPlan`` over every host's rows (``shuffle``: this host's
    ``shuffle_keys``)."""
    if jax.process_count() == 1:
        lengths, fin = rb.total_len, rb.finished
    else:
        lengths, fin = mh.gather_rows(rb.total_len), mh.gather_rows(rb.finished)
        shuffle = mh.gather_rows(shuffle)
    return RowPlan(np.asarray(lengths), np.asarray(shuffle), np.flatnonzero(fin))


def shuffle_keys(cfg: Config, step: int, rows: int) -> np.ndarray:
    """``[rows, epochs]`` random keys ordering this host's rows in each epoch's minibatches
    (as many epochs as the policy's or the critic's update has, whichever is more);
    a pure function of (seed, step, host), so a resumed run replays the same minibatches."""
    rng = np.random.default_rng([cfg.train.seed, step, jax.process_index(), 0x5EED])
    return rng.random((rows, max(cfg.optim.epochs, cfg.optim.critic_epochs)), dtype=np.float32)


def learner_input(roll: Rollout, cfg: Config, mesh: Any, step: int
                  ) -> tuple[TrainBatch, RowPlan]:
    """What ``Learner.step`` trains on for ``roll``: its batch on ``mesh`` and its
    ``RowPlan`` (``step``'s shuffle)."""
    rb = roll.rb
    batch = train_batch(rb, roll.reward, roll.correct, mesh)
    return batch, row_plan(rb, shuffle_keys(cfg, step, rb.tokens.shape[0]))


def init_value_bias(value: Any, roll: Rollout, cfg: Config) -> Any:
    """``value`` params with the critic's output bias set as ``algo.value_bias_init`` says,
    before its first update: ``mean_reward`` = the mean reward of ``roll``'s finished rows
    over all hosts (the midpoint of ``reward.correct`` and ``reward.wrong`` when none
    finished); ``zero`` leaves ``value`` as it is."""
    if cfg.algo.value_bias_init == "zero":
        return value
    tot = mh.sum_over_hosts({"fin": len(roll.fin), "reward": float(roll.reward[roll.fin].sum())})
    rc = cfg.reward
    mean = tot["reward"] / tot["fin"] if tot["fin"] else 0.5 * (rc.correct + rc.wrong)
    old = value["head_bias"]
    return {**value, "head_bias": jax.device_put(jnp.asarray(mean, old.dtype), old.sharding)}


def learn_from(learner: Learner, state: TrainState, roll: Rollout, cfg: Config, mesh: Any,
               step: int, *, first: bool, train_policy: bool = True, ref: Any = None,
               edit_targets: Callable[[Targets], Targets] | None = None
               ) -> tuple[TrainState, StepStats, TrainBatch, RowPlan]:
    """``Learner.step`` on ``roll``: the critic's output bias set first when this is its
    ``first`` update (``init_value_bias``), the rollout as the learner's input (``step``'s
    shuffle), then the step (``train_policy``, ``ref``, ``edit_targets`` as
    ``Learner.step``'s). Returns ``(state, stats, batch, rows)``."""
    if first and state.value is not None:
        state = dataclasses.replace(state, value=init_value_bias(state.value, roll, cfg))
    batch, rows = learner_input(roll, cfg, mesh, step)
    state, out = learner.step(state, batch, rows, ref=ref, edit_targets=edit_targets,
                              train_policy=train_policy)
    return state, out, batch, rows
