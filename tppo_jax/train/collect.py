"""One step's rollout: a window over every decode slot, then grading of the rows that
finished (outcome rewards, DAPO overlong shaping, the sympy verifier's process rewards).

Shared by the training loop and value pretraining (``train/value_pretrain.py``), which
collects full-length rollouts from its own scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tppo_jax.config import Config
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.rewards.grader import overlong_penalty
from tppo_jax.rollout.scheduler import RolloutBatch, TruncatedRolloutScheduler
from tppo_jax.train.setup import Run


@dataclass
class Rollout:
    """One step's rollout and its grades (this host's rows)."""

    rb: RolloutBatch
    fin: np.ndarray  # indices of the finished rows
    reward: np.ndarray  # [B] outcome reward (+ overlong shaping) of finished rows, else 0
    correct: np.ndarray  # [B] bool
    counts: dict[str, int]  # grade outcomes by reason
    samples: list[dict[str, Any]]  # readable records of the first finished rows
    token_rewards: np.ndarray | None  # [B, S] process rewards, when configured
    blame_start: np.ndarray | None  # [B] algo.blame_from_first_error: first blamed token
    steps_valid: float | None  # all-steps-valid rate of the finished rows
    idle: int  # slots left empty (paged pool short)
    t0: float  # when the step began
    t_roll: float  # seconds in the rollout, compiles included
    t_grade: float
    n_roll: int  # rollout-side compiles (decode shapes) and their seconds
    c_roll: float


def collect(run: Run, sched: TruncatedRolloutScheduler | None = None) -> Rollout:
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
    token_rewards, steps_valid = None, None
    if cfg.reward.process != "none":  # unfinished rows' completed lines too
        token_rewards, steps_valid = step_process_rewards(cfg, tok, rb, fin)
    blame = None
    if cfg.algo.blame_from_first_error:
        blame = blame_starts(tok, rb, np.flatnonzero(rb.finished & ~correct))
    t_grade = time.time() - t0 - t_roll
    n_roll, c_roll = run.steps.watch.take()
    return Rollout(rb, fin, reward, correct, counts, samples, token_rewards, blame,
                   steps_valid, idle, t0, t_roll, t_grade, n_roll, c_roll)


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


def step_process_rewards(cfg: Config, tok: Tokenizer, rb: RolloutBatch, rows: np.ndarray
                         ) -> tuple[np.ndarray, float | None]:
    """Dense ``[B, S]`` process rewards and the all-steps-valid rate of the finished ``rows``
    (None when none finished).

    A finished row is judged over its whole response. An unfinished row is judged over the
    lines it has completed so far (a cut last line waits for the next window): a step can be
    checked as soon as its line ends, so T-PPO's policy sees a slip's reward in the window that
    made it, not only through the critic once the row finishes (the policy trains on the
    current window only). A step's reward sits at its last token, so it lies in exactly one
    window; later windows of the row, and the critic's returns when it finishes, see it once.
    """
    from tppo_jax.rewards.process import process_rewards, step_token_ends
    from tppo_jax.rewards.step_verifier import verify_solution

    out = np.zeros(rb.tokens.shape, np.float32)
    done = np.zeros(len(rb.finished), bool)
    done[rows] = True
    valid = []
    for i in np.flatnonzero(rb.window_len > 0):
        ids = rb.response_tokens(int(i))
        text = tok.decode(ids)
        if not done[i]:
            text = text[:text.rfind("\n") + 1]  # complete lines only
            if not text.strip():
                continue
        rep = verify_solution(text)
        if done[i]:
            valid.append(rep.all_valid)
        ends = step_token_ends(rep, text, tok, ids)
        pr = process_rewards([rep], [ends], [len(ids)], mode=cfg.reward.process,
                             penalty=cfg.reward.process_penalty,
                             step_bonus=cfg.reward.process_bonus, num_tokens=len(ids))
        a = int(rb.prompt_len[i])
        out[i, a:a + len(ids)] = pr[0]
    return out, float(np.mean(valid)) if valid else None


def blame_starts(tok: Tokenizer, rb: RolloutBatch, wrong: np.ndarray) -> np.ndarray:
    """``[B]`` int32: the first token (a column of ``rb.tokens``) that the outcome of each
    ``wrong`` row may blame: the start of its first invalid step when the step verifier finds
    one, else its first response token; 0 (every token) for the other rows. The lines before
    a slip were right: a negative advantage there would push right arithmetic down."""
    from tppo_jax.rewards.process import step_token_ends
    from tppo_jax.rewards.step_verifier import verify_solution

    out = np.zeros(len(rb.finished), np.int32)
    for i in wrong:
        ids = rb.response_tokens(int(i))
        text = tok.decode(ids)
        rep = verify_solution(text)
        first = 0
        if rep.first_invalid:  # (None: no slip found; 0: the first step is the slip)
            first = step_token_ends(rep, text, tok, ids)[rep.first_invalid - 1] + 1
        out[i] = int(rb.prompt_len[i]) + first
    return out
