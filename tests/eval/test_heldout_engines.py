"""The held-out eval's engines belong to its caller: an ``EvalEngines`` passed to every eval of
a run compiles the decode window once; a call without one builds its own."""

from __future__ import annotations

import types

import pytest

from tppo_jax.eval.heldout import EvalEngines, generate_answers
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.rollout.decode import SamplingParams

TOK = types.SimpleNamespace(eos_ids=(3,))
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
KW = dict(max_prompt_len=8, max_response_len=6, batch_size=4)


@pytest.mark.slow  # ~8 s in one process on 2 shared cores
def test_one_engine_per_setting_compiled_once():
    model = create_model(ModelConfig.tiny(vocab_size=32, num_layers=1), seed=0)
    engines = EvalEngines()
    sampled = SamplingParams(temperature=1.0)
    first = generate_answers(model, TOK, PROMPTS, sampling=sampled, seed=1, engines=engines,
                             **KW)
    engine = engines.get(model, TOK.eos_ids, 4, 14, sampled, None)
    compiled = engine._window_fn._cache_size()
    again = generate_answers(model, TOK, PROMPTS, sampling=sampled, seed=1, engines=engines,
                             **KW)
    assert again == first and len(engines) == 1  # same weights and seed: same answers
    assert engine._window_fn._cache_size() == compiled  # the second eval compiled nothing
    greedy = generate_answers(model, TOK, PROMPTS, sampling=SamplingParams(greedy=True),
                              engines=engines, **KW)
    assert len(engines) == 2 and len(greedy) == len(PROMPTS)
    # Without a cache (a one-off eval) the call builds its own engine: the same answers.
    assert generate_answers(model, TOK, PROMPTS, sampling=sampled, seed=1, **KW) == first
