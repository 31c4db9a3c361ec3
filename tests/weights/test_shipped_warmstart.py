"""The shipped warm-starts (``tppo_jax/warmstarts/warmstart-<key>/``): at most one per config
in ``SHIPPED_CONFIGS`` (the default's at least), found by that config's current key (a change
to what the warm-start depends on fails here, not as a silent retrain in a user's first run),
copied byte for byte into the cache instead of training, and as good as stated: the default's
greedy accuracy on held-out questions."""

import logging

import pytest

from tppo_jax.config import load_config
from tppo_jax.weights.warmstart import (
    CACHE_FILES,
    SHIPPED,
    SHIPPED_CONFIGS,
    cached,
    shipped,
    warmstart_key,
)

pytestmark = pytest.mark.skipif(
    not any(SHIPPED.glob("warmstart-*")), reason="no warm-start ships in this checkout yet: "
    "python -m tppo_jax.weights.warmstart writes them")


def test_the_default_finds_its_shipped_warmstart_and_nothing_else_ships():
    names = {f"warmstart-{warmstart_key(load_config(n))}" for n in SHIPPED_CONFIGS}
    # Every shipped folder is a shipped config's current one (none left behind by a change to
    # what a warm-start depends on), and the embedded default's ships.
    assert {p.name for p in SHIPPED.glob("warmstart-*")} <= names
    folder = shipped(load_config("default"))
    assert folder == SHIPPED / f"warmstart-{warmstart_key(load_config('default'))}"
    assert all((folder / f).is_file() for f in CACHE_FILES)
    assert shipped(load_config("quick")) == folder  # the quick run starts from it too
    # A config whose warm-start differs has none: it trains its own, as before.
    assert shipped(load_config("smoke")) is None
    assert shipped(load_config("default", ["train.warmstart_steps=1599"])) is None
    # The RL settings and the held-out set's size are not part of the key.
    assert shipped(load_config("default", ["train.steps=3", "data.eval_size=16",
                                           "optim.policy_lr=3e-5"])) is not None


def test_a_matching_config_copies_the_shipped_files_instead_of_training(tmp_path, caplog):
    cfg = load_config("default")
    with caplog.at_level(logging.INFO, logger="tppo_jax.weights.warmstart"):
        cache = cached(cfg, tmp_path, progress=False)
    assert cache == tmp_path / f"warmstart-{warmstart_key(cfg)}"
    for f in CACHE_FILES:
        assert (cache / f).read_bytes() == (SHIPPED / cache.name / f).read_bytes()
    assert "shipped" in caplog.text and "SFT steps" not in caplog.text
    assert cached(cfg, tmp_path, progress=False) == cache  # then it is the cache


@pytest.mark.slow  # compiles the greedy decode (~10 s)
def test_the_shipped_default_answers_held_out_questions_greedily():
    from tppo_jax.data.run_data import prompt_rows
    from tppo_jax.eval.heldout import evaluate
    from tppo_jax.rewards.grader import MathGrader
    from tppo_jax.weights.warmstart import _load

    cfg = load_config("default", ["data.eval_size=64"])
    tok, policy = _load(cfg, shipped(cfg), None)
    _, rows, encode = prompt_rows(cfg, tok)
    assert len(rows) >= 60
    with MathGrader.from_config(cfg.reward, cfg.data.format) as grader:
        res = evaluate(policy, tok, rows, encode, grader,
                       max_prompt_len=cfg.rollout.max_prompt_len,
                       max_response_len=cfg.rollout.max_response_len)
    # results/README.md: greedy 97.6% on the 127 held-out questions (machine A and B)
    assert res["avg@1"] >= 93.0, res
