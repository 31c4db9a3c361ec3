"""Length-grouped warm-start batches: one padded width per batch, uniform rows overall."""

import numpy as np

from tppo_jax.config import load_config
from tppo_jax.weights.warmstart import WIDTH_BUCKET, batch_rows, warmstart_key


def _long_tailed_lengths(n: int = 400) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.minimum(20 + rng.geometric(1 / 60, size=n), 576)


def test_random_batching_is_the_original_uniform_draw():
    lengths = _long_tailed_lengths()
    got = batch_rows(np.random.default_rng(5), lengths, 32, by_length=False)
    np.testing.assert_array_equal(got, np.random.default_rng(5).integers(0, len(lengths), 32))


def test_by_length_batches_share_one_bucket_and_pad_less():
    lengths = _long_tailed_lengths()
    rng = np.random.default_rng(1)
    widths = {False: [], True: []}
    for by_length in (False, True):
        for _ in range(200):
            idx = batch_rows(rng, lengths, 32, by_length=by_length)
            if by_length:
                assert len(set(lengths[idx] // WIDTH_BUCKET)) == 1
            widths[by_length].append(lengths[idx].max())
    assert np.mean(widths[True]) < 0.5 * np.mean(widths[False])


def test_by_length_draws_every_row_equally_often():
    lengths = _long_tailed_lengths(200)
    rng = np.random.default_rng(2)
    counts = np.bincount(np.concatenate([batch_rows(rng, lengths, 16, by_length=True)
                                         for _ in range(5000)]), minlength=len(lengths))
    # 400 expected draws per row; a bucket-size bias (e.g. small buckets drawn as often as
    # large ones) would put some rows at several times that.
    assert counts.min() > 250 and counts.max() < 600, (counts.min(), counts.max())


def test_batching_joins_the_warmstart_key_only_when_not_random():
    base = load_config("default")
    assert warmstart_key(base) == warmstart_key(load_config(
        "default", ["train.warmstart_batching=random"]))
    assert warmstart_key(base) != warmstart_key(load_config(
        "default", ["train.warmstart_batching=by_length"]))


def test_corpus_rows_start_with_the_prompt_ids_a_rollout_sees(tmp_path):
    """The daily task's text encodes "A: day" with the space merged into "_day", while the
    prompt alone ends in a lone "_": every row must still start with the prompt's own ids
    (what a rollout continues from), with the loss on the whole solution after them."""
    from tppo_jax.data.prompts import SHORT_ANSWER_CUE
    from tppo_jax.data.synthetic import SyntheticMathTask
    from tppo_jax.models.tokenizer import train_sentencepiece
    from tppo_jax.weights.warmstart import encode_corpus

    task = SyntheticMathTask(seed=0, difficulty=2.0, max_operand=3, max_value=40,
                             max_steps=8, style="daily")
    texts = task.teacher_corpus(400)
    tok = train_sentencepiece(texts, tmp_path / "tok")
    ids, mask = encode_corpus(tok, texts, 256)
    merged = 0
    for t, row, m in zip(texts, ids, mask, strict=True):
        prompt, cue, solution = t.partition(SHORT_ANSWER_CUE)
        head = tok.encode(prompt + cue)
        merged += tok.encode(t)[:len(head)] != head
        n = int((row != 0).sum())
        assert row[:len(head)].tolist() == head
        assert row[n - 1] == tok.eos_id and m[:len(head)].sum() == 0 and m[len(head):n].all()
        assert tok.decode(row[len(head):n - 1].tolist()) == solution
    assert merged > 0  # the case the rows guard against does occur on this task


def test_the_held_out_size_does_not_change_the_warmstart_key():
    """A bigger held-out set reuses the warm-start (the teacher corpus is the train split);
    the task's own knobs still change it."""
    base = load_config("longtail")
    assert warmstart_key(base) == warmstart_key(load_config("longtail", ["data.eval_size=256"]))
    assert warmstart_key(base) != warmstart_key(load_config("longtail", ["data.max_value=41"]))


def test_the_rollout_length_that_cuts_corpus_rows_joins_the_key():
    """The corpus rows are cut at max_prompt_len + max_response_len, which changes the
    weights: two lengths, two keys (the library default's keeps its shipped key)."""
    from tppo_jax.config import RolloutConfig

    smoke = load_config("smoke")
    shorter = load_config("smoke", ["rollout.max_prompt_len=48"])
    assert warmstart_key(smoke) != warmstart_key(shorter)
    assert warmstart_key(load_config("smoke", ["rollout.max_response_len=128"])) != \
        warmstart_key(smoke)
    default = load_config("default")
    assert default.rollout.max_len == RolloutConfig().max_len == 224
    assert warmstart_key(default) == "5b2ab9466468"  # the shipped one's
