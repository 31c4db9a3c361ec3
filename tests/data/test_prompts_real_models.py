"""Real-format rows through chat templates, answer formats, EOS ids and HF config variants.

The tokenizer fixtures are small byte-level BPE vocabularies built here (no download), with
the chat templates real instruct models ship (ChatML as Qwen2.5 / SmolLM2, Llama 3's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tppo_jax.config import ConfigError, from_dict
from tppo_jax.data.prompts import BOXED_INSTRUCTION, prompt_builder, render_chat
from tppo_jax.data.readers import read_examples
from tppo_jax.models.hf import config_from_hf, from_pretrained
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.rewards.grader import MathGrader, answer_format_for, extract_answer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
          "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role']"
          " + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n'"
          " }}{% endif %}")
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\nWhat is 3+4?\n\nRemember to put your answer on its "
               "own line after \"Answer:\"")


def _tokenizer_dir(tmp: Path, specials: list[str], tok_cfg: dict, gen_cfg: dict | None) -> Path:
    """A byte-level BPE tokenizer folder: 256 byte tokens, one merge, then ``specials``."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["Ġt"] = len(vocab)
    tok = HFTok(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    if gen_cfg is not None:
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg))
    return tmp


@pytest.fixture
def qwen_tok(tmp_path) -> Tokenizer:
    # Qwen2.5-Instruct's layout: bos_token null, eos <|im_end|>, two EOS ids in generation_config.
    d = _tokenizer_dir(tmp_path / "qwen", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                       {"bos_token": None, "eos_token": "<|im_end|>",
                        "pad_token": "<|endoftext|>", "chat_template": CHATML},
                       {"eos_token_id": [259, 257]})
    return Tokenizer.load(d)


@pytest.fixture
def llama3_tok(tmp_path) -> Tokenizer:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    d = _tokenizer_dir(tmp_path / "llama3", specials,
                       {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                        "add_bos_token": True}, {"eos_token_id": 258})
    (d / "chat_template.jinja").write_text(LLAMA3)
    return Tokenizer.load(d)


def _cfg(fmt: str, **data) -> object:
    return from_dict({"model": {"source": "hf", "path": "unused"},
                      "data": {"format": fmt, **data}})


def _rows(tmp_path: Path, fmt: str, rows: list[dict]):
    p = tmp_path / f"{fmt}.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_examples(p, format=fmt)[0]


def test_tokenizer_eos_ids_and_specials(qwen_tok, llama3_tok):
    # eos_id first, then generation_config's list, then the template's end of turn; once each.
    assert qwen_tok.bos_id is None  # an explicit null is not guessed as <|endoftext|>
    assert qwen_tok.eos_id == 259 and qwen_tok.eos_ids == (259, 257)
    assert qwen_tok.chat_template == CHATML and not qwen_tok.add_bos
    eot = llama3_tok._impl.token_to_id("<|eot_id|>")
    assert llama3_tok.eos_ids == (llama3_tok.eos_id, eot)
    assert llama3_tok.add_bos and llama3_tok.chat_template == LLAMA3


def test_gsm8k_row_gets_chat_prompt_with_generation_prompt(tmp_path, qwen_tok):
    [ex] = _rows(tmp_path, "gsm8k", [{"question": "Tom has 3 apples and buys 5. How many?",
                                      "answer": "3 + 5 = 8\n#### 8"}])
    pb = prompt_builder(_cfg("gsm8k"), qwen_tok)
    text = pb.text(ex)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nTom has 3 apples and buys 5. How many?\n\n"
                    f"{BOXED_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    ids = pb.ids(ex, qwen_tok)
    assert ids[0] == qwen_tok._impl.token_to_id("<|im_start|>")
    assert qwen_tok.decode(ids, skip_special=False) == text


def test_math_and_dapo_rows(tmp_path, qwen_tok):
    [m] = _rows(tmp_path, "math", [{"problem": "Find $x$ if $2x=6$.",
                                    "solution": "So $x=\\boxed{3}$."}])
    text = prompt_builder(_cfg("math"), qwen_tok).text(m)
    assert "Find $x$ if $2x=6$.\n\n" + BOXED_INSTRUCTION in text
    assert text.endswith("<|im_start|>assistant\n")
    # DAPO rows keep their own prompt text (a chat list): no second instruction.
    [d] = _rows(tmp_path, "dapo", [{"prompt": [{"role": "user", "content": DAPO_PROMPT}],
                                    "reward_model": {"ground_truth": "7"}}])
    text = prompt_builder(_cfg("dapo"), qwen_tok).text(d)
    assert DAPO_PROMPT in text and BOXED_INSTRUCTION not in text
    assert text.endswith("<|im_start|>assistant\n")


def test_system_prompt_and_template_override(qwen_tok):
    pb = prompt_builder(_cfg("gsm8k", system_prompt="Be brief.",
                             prompt_template="Q: {question} (box it: \\boxed{})"), qwen_tok)
    assert pb.text("1+1?") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                               "Q: 1+1? (box it: \\boxed{})<|im_end|>\n<|im_start|>assistant\n")
    plain = prompt_builder(_cfg("gsm8k", chat_template=False), qwen_tok).text("1+1?")
    assert plain == f"1+1?\n\n{BOXED_INSTRUCTION}\nSolution:"
    with pytest.raises(ConfigError, match="question"):
        _cfg("gsm8k", prompt_template="no placeholder")


def test_bos_rendered_by_template_is_not_doubled(llama3_tok):
    pb = prompt_builder(_cfg("gsm8k"), llama3_tok)
    text = pb.text("2+2?")
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
    ids = pb.ids("2+2?", llama3_tok)
    assert ids[0] == llama3_tok.bos_id and ids[1] != llama3_tok.bos_id
    # Without a template the tokenizer's add_bos_token puts BOS in front, once.
    plain = prompt_builder(_cfg("gsm8k", chat_template=False), llama3_tok)
    ids = plain.ids("2+2?", llama3_tok)
    assert ids.count(llama3_tok.bos_id) == 1 and ids[0] == llama3_tok.bos_id


def test_render_chat_matches_transformers_conventions():
    # trim_blocks / lstrip_blocks as transformers sets them; raise_exception reaches the caller.
    t = "{% for m in messages %}\n  {% if m %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat(t, msgs) == "ab"  # (without them: "  a\n  b\n")
    with pytest.raises(ValueError, match="only user"):
        render_chat("{{ raise_exception('only user') }}", [])


@pytest.mark.parametrize("fmt,completion,answer,expected", [
    ("boxed", "so \\boxed{8}", "8", "ok"),
    ("boxed", "Answer: 8", "8", "no_answer"),
    ("answer_line", "work\nAnswer: $34$", "34", "ok"),
    ("answer_line", "\\boxed{34}", "34", "no_answer"),
    ("boxed_or_answer_line", "Answer: 34", "34", "ok"),
    ("last_number", "3 + 5 = 8 apples.", "8", "ok"),
    ("last_number", "It is 1,000.", "1000", "ok"),
    ("last_number", "no digits here", "8", "no_answer"),
])
def test_answer_formats_graded_from_config(fmt, completion, answer, expected):
    cfg = from_dict({"reward": {"answer_format": fmt, "workers": 0}})
    with MathGrader.from_config(cfg.reward, cfg.data.format) as grader:
        assert grader.grade([completion], [answer]).reasons == [expected]


def test_answer_format_defaults_per_data_format():
    assert answer_format_for("dapo") == "answer_line"
    assert answer_format_for("gsm8k") == "boxed_or_answer_line"
    assert answer_format_for("math") == "boxed"
    assert answer_format_for("math", "last_number") == "last_number"
    # DAPO's own instruction is honoured by the default: "Answer: 34" is an answer.
    cfg = from_dict({"data": {"format": "dapo"}, "reward": {"workers": 0, "no_answer": -1.0}})
    with MathGrader.from_config(cfg.reward, cfg.data.format) as grader:
        g = grader.grade(["Answer: 34", "I think 34"], ["34", "34"])
    assert g.reasons == ["ok", "no_answer"] and g.rewards.tolist() == [1.0, -1.0]
    assert extract_answer("x \\boxed{2} y\nAnswer: 3", answer_format="last_number") == "2"


def test_model_type_only_config_loads(tmp_path):
    src = FIXTURES / "llama"
    d = json.loads((src / "config.json").read_text())
    d.pop("architectures")
    assert config_from_hf(d).qkv_bias is False  # "model_type": "llama" alone is enough
    folder = tmp_path / "llama"
    shutil.copytree(src, folder)
    (folder / "config.json").write_text(json.dumps(d))
    a, b = from_pretrained(src), from_pretrained(folder)
    ids = np.array([[1, 5, 9, 3]], np.int32)
    np.testing.assert_array_equal(np.asarray(a(ids)), np.asarray(b(ids)))


@pytest.mark.parametrize("patch,match", [
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "no 'factor'"),
])
def test_unsupported_hf_configs_are_one_line_errors(patch, match):
    d = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
    d.pop("architectures")
    d.update(patch)
    with pytest.raises(ValueError, match=match) as e:
        config_from_hf(d)
    assert "\n" not in str(e.value)


def test_rope_scaling_linear_and_v4_keys():
    d = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
    d.pop("rope_parameters", None)
    d.update(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    cfg = config_from_hf(d)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling_dict == {"type": "linear", "factor": 2.0}


def test_samples_jsonl_and_tensorboard_text(tmp_path):
    from tppo_jax.runs.metrics import MetricsWriter

    sample = {"prompt": "<|im_start|>user\n1+1?", "completion": "\\boxed{2}", "answer": "2",
              "reward": 1.0, "reason": "ok"}
    m = MetricsWriter(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        m.write(step, {"reward_mean": 1.0})
        m.write_samples(step, [sample, {**sample, "reason": "wrong", "reward": 0.0}])
    m.close()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3] and rows[1]["reason"] == "wrong"
    assert any((tmp_path / "tensorboard").iterdir())
    # A resumed run drops the samples logged after its checkpoint, as it does metrics.
    MetricsWriter(tmp_path, tensorboard=False, resume_step=2).close()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
