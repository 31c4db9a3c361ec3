"""A training run's held-out eval: before training (kept in the checkpoint and
``eval_before.json``), at the eval cadence and after."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from tppo_jax.eval.diagnose import no_answer_warning
from tppo_jax.eval.heldout import evaluate
from tppo_jax.eval.protocol import run_protocol
from tppo_jax.learner.state import TrainState
from tppo_jax.trainer.ema import evaluated
from tppo_jax.trainer.policy_view import policy_module

if TYPE_CHECKING:
    from tppo_jax.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def heldout_eval(run: Trainer, state: TrainState, *, live: bool = False) -> dict[str, float]:
    """Held-out accuracy under the ``run`` protocol (``eval.protocol``): avg@k sampled as in
    training (the headline) and greedy, of the run's result policy (the average, with
    ``optim.policy_ema``; ``live``: the params rollouts sample from)."""
    if not live:
        state = evaluated(state, run.cfg)
    p = run_protocol(run.cfg)
    kw = dict(max_prompt_len=run.cfg.rollout.max_prompt_len, max_response_len=p.max_tokens,
              mesh=run.decode_mesh, engines=run.eval_engines)
    k, tok = p.samples, run.models.tokenizer
    sampled = evaluate(policy_module(run, state), tok, run.eval_rows, run.encode, run.grader,
                       k=k, sampling=p.sampling, seed=p.seed, **kw)
    greedy = evaluate(policy_module(run, state), tok, run.eval_rows, run.encode, run.grader,
                      **kw)
    return eval_record(sampled, greedy, k)


def eval_record(sampled: dict[str, Any], greedy: dict[str, Any], k: int) -> dict[str, Any]:
    """A held-out eval's record (``summary.json``'s ``eval_before`` / ``eval_after``) from
    its sampled (``k`` per question) and greedy ``evaluate`` results: the headline avg@k as
    ``accuracy``, the greedy results under ``greedy_``."""
    return {"accuracy": sampled[f"avg@{k}"], "greedy_accuracy": greedy["avg@1"],
            **sampled, **{f"greedy_{n}": v for n, v in greedy.items()}}


def eval_before(run: Trainer, state: TrainState) -> dict[str, Any]:
    """The held-out eval before training: from the checkpoint or the run dir on a resume,
    else run now; written to ``eval_before.json``."""
    if run.eval_before is None:
        if run.start:
            run.eval_before = json.loads((run.run_dir / "eval_before.json").read_text())
        else:
            run.eval_before = heldout_eval(run, state)
            run.metrics.write_eval(state.step, "before", run.eval_before)
            _warn_no_answer(run)
    if run.primary:
        (run.run_dir / "eval_before.json").write_text(json.dumps(run.eval_before))
    return run.eval_before


def _warn_no_answer(run: Trainer) -> None:
    """Warns when the starting policy's sampled answers almost never hold an answer the
    grader reads: every reward would be the no-answer one and the run would learn nothing."""
    from tppo_jax.rewards.grader import answer_format_for

    fmt = answer_format_for(run.cfg.data.format, run.cfg.reward.answer_format)
    warn = no_answer_warning(run.eval_before.get("no_answer"), fmt)
    if warn and run.primary:
        log.warning("eval before training: %s", warn.removeprefix("warning: "))
