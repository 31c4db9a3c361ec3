"""Tokenizer over sentencepiece and HF tokenizer.json; prompt templates."""

import random

import pytest

from tppo_jax.data.prompts import BOXED_INSTRUCTION, PromptBuilder, short_prompt
from tppo_jax.models.tokenizer import Tokenizer, train_sentencepiece


def _corpus(n=300):
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out.append(f"Q: What is {a} + {b}?\nA: {a} + {b} = {a + b}. "
                   f"The answer is \\boxed{{{a + b}}}.")
    return out


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / "math"
    return train_sentencepiece(_corpus(), prefix, vocab_size=128)


def test_sentencepiece_trains_small_vocab(spm_tok):
    assert spm_tok.backend == "sentencepiece"
    assert 20 < spm_tok.vocab_size <= 128
    assert (spm_tok.pad_id, spm_tok.bos_id, spm_tok.eos_id) == (0, 2, 3)


def test_sentencepiece_digits_are_single_pieces(spm_tok):
    ids = spm_tok.encode("1234567890")
    pieces = [spm_tok._impl.id_to_piece(i) for i in ids]
    assert [p.lstrip("\u2581") for p in pieces if p.lstrip("\u2581")] == list("1234567890")


def test_sentencepiece_round_trip_and_specials(spm_tok):
    text = short_prompt("What is 12 + 7?") + "19 \\boxed{19}"
    ids = spm_tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == spm_tok.bos_id and ids[-1] == spm_tok.eos_id
    assert spm_tok.decode(ids) == text
    assert spm_tok.encode_batch(["1", "2"]) == [spm_tok.encode("1"), spm_tok.encode("2")]


def test_load_from_directory(spm_tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tokdir")
    train_sentencepiece(_corpus(50), d / "tokenizer", vocab_size=64)
    assert Tokenizer.load(d).backend == "sentencepiece"


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<s>", "</s>",
                                                                   "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return Tokenizer.load(path)


def test_hf_backend(hf_tok):
    assert hf_tok.backend == "hf"
    assert (hf_tok.pad_id, hf_tok.bos_id, hf_tok.eos_id) == (0, 1, 2)
    assert hf_tok.vocab_size == hf_tok._impl.get_vocab_size(with_added_tokens=True) >= 260
    text = "Q: What is 12 + 7?\nA: \\boxed{19}"
    ids = hf_tok.encode(text, add_eos=True)
    assert ids[-1] == hf_tok.eos_id
    assert hf_tok.decode(ids) == text


def test_prompt_templates():
    long = PromptBuilder().text("  What is 2+2? ")
    assert long.startswith("What is 2+2?\n\n" + BOXED_INSTRUCTION) and "\\boxed{}" in long
    assert PromptBuilder(short=True).text("What is 2+2?") == "Q: What is 2+2?\nA: "
