"""Length-grouped warm-start batches: one padded width per batch, uniform rows overall."""

import numpy as np

from tppo_jax.config import load_config
from tppo_jax.train.warmstart import WIDTH_BUCKET, batch_rows, warmstart_key


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
