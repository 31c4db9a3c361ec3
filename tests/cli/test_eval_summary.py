"""``tppo eval RUN`` prints one line a person reads (the JSON report holds the rest)."""

from pathlib import Path

from tppo_jax.cli.runs import eval_summary


def test_sampled_and_greedy_summaries():
    sampled = {"k": 4, "step": 30, "start": False, "greedy": False, "questions": 127,
               "avg@4": 85.23, "pass@4": 96.06, "no_answer": 0.0,
               "protocol": {"name": "run", "temperature": 1.0, "top_p": 1.0}}
    assert eval_summary(sampled, Path("runs/r1")) == (
        "r1 step 30: 127 held-out questions, run protocol, k=4, temperature 1, top_p 1: "
        "avg@4 85.2%, pass@4 96.1%")
    greedy = {"k": 1, "step": 0, "start": True, "greedy": True, "questions": 127,
              "avg@1": 97.64, "pass@1": 97.64, "no_answer": 1.57, "protocol": None}
    assert eval_summary(greedy, Path("r1")) == (
        "r1 start: 127 held-out questions, greedy: accuracy 97.6%, no answer 1.6%")


def test_an_export_has_a_tokenizer_config_naming_the_tokenizer(tmp_path):
    """``tppo export`` writes ``tokenizer_config.json`` when the run's tokenizer has none
    (the tiny model's sentencepiece): the class transformers loads ``tokenizer.model`` with
    and its special tokens, which our own loader reads back to the same ids."""
    import shutil

    from tppo_jax.cli.runs import hf_tokenizer_config
    from tppo_jax.models.tokenizer import Tokenizer, train_sentencepiece

    tok = train_sentencepiece(["1 + 2 = 3\n", "so the answer is \\boxed{3}\n"] * 20,
                              tmp_path / "sp" / "tokenizer", vocab_size=40)
    cfg = hf_tokenizer_config(tok)
    assert cfg["tokenizer_class"] == "LlamaTokenizer" and cfg["legacy"] is True
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == (
        "<s>", "</s>", "<pad>", "<unk>")
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    shutil.copy(tmp_path / "sp" / "tokenizer.model", tmp_path / "tokenizer.model")
    again = Tokenizer.load(tmp_path)
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
