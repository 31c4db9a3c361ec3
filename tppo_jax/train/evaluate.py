"""Held-out evaluation: decode answers for a list of examples and grade them (avg@k, pass@k)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tppo_jax.data.readers import MathExample
from tppo_jax.eval.metrics import avg_at_k, pass_at_k_batch
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.rewards.math import MathGrader
from tppo_jax.rewards.steps import verify_solution
from tppo_jax.rollout.generate import SamplingParams, prefill_and_decode


def generate_answers(model: nnx.Module, tok: Tokenizer, prompts: Sequence[list[int]], *,
                     max_prompt_len: int, max_response_len: int, sampling: SamplingParams,
                     batch_size: int = 64, seed: int = 0) -> list[list[int]]:
    """Decodes one response per prompt (one window of ``max_response_len``), batched."""
    s = max_prompt_len + max_response_len
    out: list[list[int]] = []
    for lo in range(0, len(prompts), batch_size):
        chunk = list(prompts[lo:lo + batch_size])
        n = len(chunk)
        chunk += [chunk[-1]] * (batch_size - n)  # fixed batch shape: no recompiles
        tokens = np.zeros((batch_size, s), np.int32)
        lens = np.zeros(batch_size, np.int32)
        for i, ids in enumerate(chunk):
            ids = ids[-max_prompt_len:]
            tokens[i, :len(ids)] = ids
            lens[i] = len(ids)
        cache = model.init_cache(batch_size, s)
        res, _ = prefill_and_decode(
            model, cache, jnp.asarray(tokens), jnp.asarray(lens), jnp.ones(batch_size, bool),
            jnp.ones(batch_size, bool), jnp.full(batch_size, max_response_len, jnp.int32),
            jax.random.key(seed), jnp.arange(lo, lo + batch_size, dtype=jnp.uint32), jnp.int32(0),
            window=max_response_len, eos_id=tok.eos_id, params=sampling)
        toks, count = jax.device_get((res.tokens, res.count))
        out.extend(toks[i, :count[i]].tolist() for i in range(n))
    return out


def evaluate(model: nnx.Module, tok: Tokenizer, examples: Sequence[MathExample],
             encode_prompt: Callable[[MathExample], list[int]], grader: MathGrader, *,
             max_prompt_len: int, max_response_len: int, k: int = 1,
             sampling: SamplingParams | None = None, seed: int = 0) -> dict[str, float]:
    """Accuracy of ``k`` samples per example: ``avg@k`` (percent) and ``pass@k``.

    Greedy decoding when ``sampling`` is None (then ``k`` must be 1).
    """
    sampling = sampling or SamplingParams(greedy=True)
    prompts = [encode_prompt(e) for e in examples for _ in range(k)]
    responses = generate_answers(model, tok, prompts, max_prompt_len=max_prompt_len,
                                 max_response_len=max_response_len, sampling=sampling, seed=seed)
    texts = [tok.decode(r) for r in responses]
    answers = [e.answer for e in examples for _ in range(k)]
    graded = grader.grade(texts, answers)
    correct = graded.correct.reshape(len(examples), k)
    lengths = np.array([len(r) for r in responses])
    steps_ok = np.array([verify_solution(t).all_valid for t in texts])
    return {
        f"avg@{k}": avg_at_k(correct),
        f"pass@{k}": float(np.mean(pass_at_k_batch(np.full(len(examples), k),
                                                   correct.sum(axis=1), k)) * 100.0),
        "response_len_mean": float(lengths.mean()),
        "boxed_frac": float(np.mean([r != "no_answer" for r in graded.reasons])),
        # Step-level checking (sympy verifier): all steps valid; right answer but a bad step.
        "steps_all_valid_frac": float(steps_ok.mean()),
        "right_answer_wrong_steps_frac": float((graded.correct & ~steps_ok).mean()),
    }
