"""Held-out evaluation: decode answers for a list of examples and grade them (avg@k, pass@k).

Decoding goes through the rollout's ``DecodeEngine`` (``decode_prompts``: one window of the
response length per batch of prompts), so the eval samples exactly as training does. Its
jitted window compiles once per engine: a caller that evaluates repeatedly (a training run,
a sweep) keeps one ``EvalEngines`` and passes it to every call; without one, each call
builds its own engine.

With several processes each host decodes and grades its share of the examples; the
per-example results are gathered, so every host returns the same metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from tppo_jax.buckets import bucket_width
from tppo_jax.data.readers import MathExample
from tppo_jax.eval.metrics import score
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.parallel import multihost as mh
from tppo_jax.rewards.grader import REASONS, MathGrader
from tppo_jax.rewards.step_verifier import verify_solution
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine

# Prompts decoded at once (global over hosts): the eval engine's slots.
BATCH_SIZE = 64


class EvalEngines:
    """The eval's decode engines, one per model shape and decode setting (weights and seed
    are per call): held by whoever evaluates repeatedly, so each engine's window compiles
    once, not at every evaluation."""

    def __init__(self) -> None:
        self._engines: dict[tuple, DecodeEngine] = {}

    def get(self, model: nnx.Module, eos_ids: Sequence[int], batch_size: int, max_len: int,
            sampling: SamplingParams, mesh: Any) -> DecodeEngine:
        key = (repr(model.config), batch_size, max_len, sampling, tuple(eos_ids), mesh)
        if key not in self._engines:
            engine = DecodeEngine(model, eos_ids=eos_ids, max_slots=batch_size,
                                  max_target_length=max_len, kv_cache="dense",
                                  sampling=sampling, mesh=mesh)
            engine.drop_initial_params()  # each eval passes its own weights
            self._engines[key] = engine
        return self._engines[key]

    def __len__(self) -> int:
        return len(self._engines)


def generate_answers(model: nnx.Module, tok: Tokenizer, prompts: Sequence[list[int]], *,
                     max_prompt_len: int, max_response_len: int, sampling: SamplingParams,
                     batch_size: int = BATCH_SIZE, seed: int = 0, mesh: Any = None,
                     engines: EvalEngines | None = None) -> list[list[int]]:
    """Decodes one response per prompt through the rollout engine (one window of
    ``max_response_len``), ``batch_size`` slots at a time.

    With a mesh the slots are sharded over it; with several processes ``prompts`` are this
    host's and ``batch_size`` is the global batch (every host runs the same batch count).
    ``engines``: where the engine is kept between calls (default: built for this call).
    """
    s = max_prompt_len + max_response_len
    hosts, me = jax.process_count(), jax.process_index()
    local_bs = mh.local_count(batch_size)
    n_batches = -(-int(mh.max_over_hosts({"n": len(prompts)})["n"]) // local_bs)
    engines = EvalEngines() if engines is None else engines
    engine = engines.get(model, tok.eos_ids, batch_size, s, sampling, mesh)
    params = engine.load_params(model)
    # The prefill runs over the prompt columns only (a width every host agrees on), not over
    # the response part of the cache's buffer.
    width = bucket_width(max_prompt_len, s)
    out: list[list[int]] = []
    for b in range(n_batches):
        lo = b * local_bs
        chunk = list(prompts[lo:lo + local_bs]) or [prompts[-1] if prompts else [0]]
        n = max(0, min(len(prompts) - lo, local_bs))  # real rows (a host may run out)
        chunk += [chunk[-1]] * (local_bs - len(chunk))  # fixed batch shape: no recompiles
        tokens = np.zeros((local_bs, width), np.int32)
        lens = np.zeros(local_bs, np.int32)
        for i, ids in enumerate(chunk):
            ids = ids[-max_prompt_len:]
            tokens[i, :len(ids)] = ids
            lens[i] = len(ids)
        # Row ids seed the sampling streams: globally unique across batches and hosts.
        row_ids = b * local_bs * hosts + me * local_bs + np.arange(local_bs)
        res = engine.decode_prompts(params, tokens, lens, max_response_len, seq_ids=row_ids,
                                    seed=seed)
        toks, count = mh.tree_to_host((res.tokens, res.count))
        out.extend(toks[i, :count[i]].tolist() for i in range(n))
    return out


@dataclass(frozen=True)
class GradedSamples:
    """``k`` graded samples of each of ``N`` examples, every host's, in host order (one
    host: example order; ``index`` maps rows back to positions in ``examples``).

    ``correct`` / ``reasons``: ``[N, k]``, the grader's verdict and reason (``REASONS``);
    ``lengths``: ``[N * k]`` response tokens; ``steps_ok``: ``[N * k]`` all steps valid (None
    when not checked); ``texts``: this host's decoded responses, ``k`` per example.
    """

    index: np.ndarray
    correct: np.ndarray
    reasons: np.ndarray
    lengths: np.ndarray
    steps_ok: np.ndarray | None
    texts: list[str]


def decode_and_grade(model: nnx.Module, tok: Tokenizer, examples: Sequence[MathExample],
                     encode_prompt: Callable[[MathExample], list[int]], grader: MathGrader, *,
                     max_prompt_len: int, max_response_len: int, k: int = 1,
                     sampling: SamplingParams | None = None, seed: int = 0, mesh: Any = None,
                     engines: EvalEngines | None = None, batch_size: int = BATCH_SIZE,
                     check_steps: bool = True) -> GradedSamples:
    """Decodes ``k`` samples per example (greedy when ``sampling`` is None) and grades them:
    the one sampling-and-grading path of the held-out eval and the benchmark eval.

    Every host passes the full ``examples``; each decodes and grades its share, and the
    per-sample results are gathered (see the module docstring). ``check_steps``: also run
    the sympy step verifier on every response (the held-out eval's step metrics).
    """
    sampling = sampling or SamplingParams(greedy=True)
    index = mh.split_for_host(list(range(len(examples))))
    mine = [examples[i] for i in index]
    prompts = [encode_prompt(e) for e in mine for _ in range(k)]
    responses = generate_answers(model, tok, prompts, max_prompt_len=max_prompt_len,
                                 max_response_len=max_response_len, sampling=sampling, seed=seed,
                                 mesh=mesh, engines=engines, batch_size=batch_size)
    texts = [tok.decode(r) for r in responses]
    graded = grader.grade(texts, [e.answer for e in mine for _ in range(k)],
                          [e for e in mine for _ in range(k)])
    codes = np.array([REASONS.index(r) for r in graded.reasons], np.int64).reshape(len(mine), k)
    steps = (mh.gather_rows(np.array([verify_solution(t).all_valid for t in texts], bool))
             if check_steps else None)
    return GradedSamples(
        index=mh.gather_rows(np.array(index, np.int64)),
        correct=mh.gather_rows(graded.correct.reshape(len(mine), k)),
        reasons=np.array(REASONS, dtype=object)[mh.gather_rows(codes)],
        lengths=mh.gather_rows(np.array([len(r) for r in responses], np.int64)),
        steps_ok=steps, texts=texts)


def evaluate(model: nnx.Module, tok: Tokenizer, examples: Sequence[MathExample],
             encode_prompt: Callable[[MathExample], list[int]], grader: MathGrader, *,
             max_prompt_len: int, max_response_len: int, k: int = 1,
             sampling: SamplingParams | None = None, seed: int = 0, mesh: Any = None,
             engines: EvalEngines | None = None) -> dict[str, float]:
    """Accuracy of ``k`` samples per example: ``avg@k`` (percent) and ``pass@k``
    (``eval.metrics.score``, as the benchmark eval reports them).

    Greedy decoding when ``sampling`` is None (then ``k`` must be 1). Every host passes
    the full ``examples``; each decodes and grades its share (see the module docstring).
    ``engines``: as ``generate_answers`` takes it.
    """
    g = decode_and_grade(model, tok, examples, encode_prompt, grader,
                         max_prompt_len=max_prompt_len, max_response_len=max_response_len, k=k,
                         sampling=sampling, seed=seed, mesh=mesh, engines=engines)
    correct, steps_ok = g.correct, g.steps_ok
    metrics = score(correct, ks=(k,))
    # k = 1 (greedy): which questions were right ("x") or not ("."), in example order, so two
    # evals of the same questions count the answers that changed (tppo bench learning)
    mask = {"correct_mask": "".join("x" if c else "." for c in correct[:, 0])} if k == 1 else {}
    return {
        f"avg@{k}": metrics[f"avg@{k}"],
        f"pass@{k}": metrics[f"pass@{k}"],
        "response_len_mean": float(g.lengths.mean()),
        "boxed_frac": float((g.reasons != "no_answer").reshape(-1).mean()),
        # percent, as accuracies: answers with nothing the grader could read
        "no_answer": float(100.0 * (g.reasons == "no_answer").reshape(-1).mean()),
        # Step-level checking (sympy verifier): all steps valid; right answer but a bad step.
        "steps_all_valid_frac": float(steps_ok.mean()),
        "right_answer_wrong_steps_frac": float((correct.reshape(-1) & ~steps_ok).mean()),
        **mask,
    }


def eval_record(sampled: dict[str, Any], greedy: dict[str, Any], k: int) -> dict[str, Any]:
    """A held-out eval's record (``summary.json``'s ``eval_before`` / ``eval_after``) from
    its sampled (``k`` per question) and greedy ``evaluate`` results: the headline avg@k as
    ``accuracy``, the greedy results under ``greedy_``."""
    return {"accuracy": sampled[f"avg@{k}"], "greedy_accuracy": greedy["avg@1"],
            **sampled, **{f"greedy_{n}": v for n, v in greedy.items()}}
