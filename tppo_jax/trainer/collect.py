"""One step's rollout: a window over every decode slot, then grading of the rows that
finished (outcome rewards, DAPO overlong shaping).

Shared by the training loop and value pretraining (``trainer/value_pretrain.py``), which
collects full-length rollouts from its own scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.rewards.grader import overlong_penalty
from tppo_jax.rollout.scheduler import RolloutBatch, TruncatedRolloutScheduler
from tppo_jax.trainer.trainer import Trainer


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


def collect(run: Trainer, sched: TruncatedRolloutScheduler | None = None) -> Rollout:
    """One rollout window over every slot (of ``sched``, default the run's), then grading
    of the rows that finished."""
    cfg, tok = run.cfg, run.models.tokenizer
    sched = run.sched if sched is None else sched
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
        g = run.grader.grade(texts, [rb.examples[i].answer for i in fin],
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
                              cfg.logging.samples_per_step)
    t_grade = time.time() - t0 - t_roll
    n_roll, c_roll = run.watch.take()
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
                reward: np.ndarray, reasons: list[str], n: int) -> list[dict[str, Any]]:
    """The first ``n`` finished rows as readable records (prompt, completion, grade)."""
    out = []
    for j, i in enumerate(rows[:n]):
        prompt = tok.decode(rb.tokens[i, :int(rb.prompt_len[i])], skip_special=False)
        out.append({"prompt": prompt, "completion": texts[j], "answer": rb.examples[i].answer,
                    "reward": float(reward[i]), "reason": reasons[j]})
    return out
