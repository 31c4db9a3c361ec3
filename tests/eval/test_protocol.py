"""One eval spec: the in-run held-out eval, `tppo eval RUN` and `tppo eval --benchmark` draw
answers by an ``EvalProtocol``, ``run`` (the run's training sampling) or ``paper``."""

import pytest

from tppo_jax.config import load_config
from tppo_jax.eval.protocol import paper_protocol, protocol_named, run_protocol


def test_run_protocol_is_the_runs_training_sampling():
    cfg = load_config(None, ["rollout.temperature=0.8", "rollout.top_p=0.9", "rollout.top_k=5",
                             "train.eval_samples=3", "train.seed=7",
                             "rollout.max_response_len=96"])
    p = run_protocol(cfg)
    assert (p.name, p.samples, p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (
        "run", 3, 0.8, 0.9, 5, 96, 7)
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.greedy) == (0.8, 0.9, 5, False)
    assert protocol_named("run", cfg) == p


def test_paper_protocol_and_overrides_say_what_changed():
    cfg = load_config(None, ["rollout.max_response_len=64"])
    p = paper_protocol(cfg)
    assert (p.name, p.samples, p.temperature, p.top_p, p.max_tokens, p.seed) == (
        "paper", 8, 1.0, 0.7, 64, 0)
    assert p.overridden(samples=8, top_p=0.7) is p  # the protocol's own values: unchanged
    q = p.overridden(samples=4, temperature=0.0)
    assert (q.name, q.samples, q.temperature, q.top_p) == ("paper+", 4, 0.0, 0.7)
    assert q.sampling.greedy and q.overridden(seed=3).name == "paper+"
    assert q.to_dict()["name"] == "paper+"
    with pytest.raises(ValueError, match="protocol must be one of"):
        protocol_named("papers", cfg)
