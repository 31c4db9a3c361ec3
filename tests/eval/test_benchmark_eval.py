"""``tppo eval --benchmark``: the protocol's numbers against hand-computed ones (scripted
completions on a tiny HF folder), a real decode of a Hub model id on a named benchmark read
offline from a datasets cache the test lays out, and one-line errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tppo_jax.cli import main
from tppo_jax.eval import heldout
from tppo_jax.eval.metrics import pass_ks, score, standard_error
from tppo_jax.models.tokenizer import Tokenizer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"
QUESTIONS = [{"problem": "What is 1+2?", "answer": "3"},
             {"problem": "What is 3+4?", "answer": "7"},
             {"problem": "What is 3*4?", "answer": "12"}]
# Scripted completions: greedy right / wrong / no answer; 4 samples per question with
# 2, 1 and 0 right answers.
GREEDY = ["so \\boxed{3}", "so \\boxed{8}", "I do not know"]
SAMPLES = [["\\boxed{3}", "\\boxed{4}", "no idea", "\\boxed{3}"],
           ["\\boxed{7}", "hmm", "hmm", "\\boxed{1}"],
           ["\\boxed{1}", "\\boxed{2}", "\\boxed{5}", "\\boxed{6}"]]


def _hub_cache():
    """``tests/data/hub_cache.py`` (the project's offline datasets caches)."""
    if "hub_cache" in sys.modules:
        return sys.modules["hub_cache"]
    spec = importlib.util.spec_from_file_location(
        "hub_cache", Path(__file__).parents[1] / "data" / "hub_cache.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hub_cache"] = module
    spec.loader.exec_module(module)
    return module


def _hf_folder(dest: Path) -> Path:
    """The tiny qwen2 fixture with a real ``tokenizer.json`` over its 256 ids (words
    ``w3..w255``, ``</s>`` its EOS): an HF folder ``tppo eval`` loads as a user's."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("*.npz", "greedy.json"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 256)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"bos_token": None,
                                                            "eos_token": "</s>"}))
    return dest


@pytest.fixture
def bench_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An AIME-style JSONL, a tiny HF folder and an inline-grading config, in ``tmp_path``
    (the working directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "aime.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "grade.yaml").write_text("reward:\n  workers: 0\n")
    _hf_folder(tmp_path / "tiny")
    return tmp_path


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding replaced by ``GREEDY`` / ``SAMPLES``: token id ``i`` decodes to text ``i``."""
    texts: list[str] = []

    def fake_generate(model, tok, prompts, *, sampling, **kw):
        script = GREEDY if sampling.greedy else [t for q in SAMPLES for t in q]
        assert len(prompts) == len(script)  # question order, k samples in a row
        texts.extend(script)
        return [[len(texts) - len(script) + i] for i in range(len(script))]

    monkeypatch.setattr(heldout, "generate_answers", fake_generate)
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, **kw: texts[ids[0]])


def _run(*argv: str) -> int:
    return main(["eval", *argv])


def test_scripted_benchmark_matches_hand_computed_numbers(bench_files, scripted, capsys):
    assert _run("tiny", "--benchmark", "aime.jsonl", "--format", "math", "-k", "4",
                "--config", "grade.yaml", "--out", "out.json") == 0
    table = capsys.readouterr().out
    report = json.loads((bench_files / "out.json").read_text())
    m = report["metrics"]
    # Greedy: 1 right of 3; binomial SE sqrt(p(1-p)/(N-1)) in percent.
    assert m["greedy_accuracy"] == pytest.approx(100 / 3)
    assert m["greedy_accuracy_se"] == pytest.approx(100 * np.sqrt((1 / 3) * (2 / 3) / 2))
    assert m["greedy_no_answer"] == pytest.approx(100 / 3)  # apart from the wrong one
    assert m["greedy_wrong"] == pytest.approx(100 / 3)
    # Samples: c = 2, 1, 0 of n = 4. pass@2 = mean(1 - C(2,2)/C(4,2), 1 - C(3,2)/C(4,2), 0).
    assert m["avg@4"] == pytest.approx(100 * 3 / 12)
    assert m["pass@1"] == pytest.approx(m["avg@4"])
    assert m["pass@2"] == pytest.approx(100 * ((1 - 1 / 6) + (1 - 3 / 6) + 0) / 3)
    assert m["pass@4"] == pytest.approx(100 * 2 / 3)
    assert m["no_answer"] == pytest.approx(100 * 3 / 12)  # "no idea", "hmm", "hmm"
    assert m["wrong"] == pytest.approx(100 * 6 / 12) and m["grade_error"] == 0.0
    assert set(m) >= {"avg@4_se", "pass@2_se", "pass@4_se", "at_max_tokens"}
    assert report["questions"] == 3 and report["protocol"]["samples"] == 4
    assert report["benchmark"]["format"] == "math"
    assert report["protocol"]["answer_format"] == "boxed"
    q = report["per_question"]
    assert [x["greedy_answer"] for x in q] == ["3", "8", None]
    assert [x["greedy_correct"] for x in q] == [True, False, False]
    assert [x["greedy_reason"] for x in q] == ["ok", "wrong", "no_answer"]
    assert [x["greedy_completion"] for x in q] == GREEDY
    assert q[0]["greedy_why"] is None and "answer_format=boxed" in q[2]["greedy_why"]
    assert q[0]["sample_completions"] == SAMPLES[0]
    assert q[0]["correct"] == [True, False, False, True]
    assert q[0]["sample_answers"] == ["3", "4", None, "3"]
    assert [x["id"] for x in q] == ["aime.jsonl-0", "aime.jsonl-1", "aime.jsonl-2"]
    for line in ("greedy accuracy", "avg@4", "pass@2", "no answer (of 4)"):
        assert line in table


def test_show_prints_completions_and_no_answer_warns(bench_files, scripted, monkeypatch,
                                                    capsys):
    monkeypatch.setattr(sys.modules[__name__], "GREEDY", ["hmm", "so 8", "I do not know"])
    assert _run("tiny", "--benchmark", "aime.jsonl", "--format", "math", "--greedy",
                "--show", "2", "--config", "grade.yaml") == 0
    out, err = capsys.readouterr()
    assert out.count("=== question") == 2 and "--- greedy completion\nso 8\n" in out
    assert "What is 3+4?" in out  # the prompt as the model saw it
    assert "no_answer (no answer found: reward.answer_format=boxed" in out
    # every greedy answer lacks a \boxed{}: one warning line naming the format and the fix
    warn = [x for x in err.splitlines() if x.startswith("warning: 100% of answers")]
    assert len(warn) == 1 and "reward.answer_format" in warn[0] and "\\boxed" in warn[0]
    assert (bench_files / "results-eval" / "tiny" / "aime_greedy.json").is_file()


def test_limit_and_greedy_only_write_their_own_file(bench_files, scripted, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "GREEDY", GREEDY[:2])
    assert _run("tiny", "--benchmark", "aime.jsonl", "--format", "math", "--greedy",
                "--limit", "2", "--config", "grade.yaml") == 0
    out = bench_files / "results-eval" / "tiny" / "aime-limit2_greedy.json"
    report = json.loads(out.read_text())
    assert report["questions"] == 2 and report["protocol"]["limit"] == 2
    assert "avg@8" not in report["metrics"] and "correct" not in report["per_question"][0]
    assert report["metrics"]["greedy_accuracy"] == 50.0


@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_a_hub_model_on_a_named_benchmark_offline(tmp_path, monkeypatch, capsys):
    """Real decoding: ``gsm8k`` read from the datasets cache an online load leaves, the model
    ``owner/tiny`` from the HF hub cache, nothing on the network."""
    hub_cache = _hub_cache()
    home = hub_cache.offline_home(tmp_path / "hf", monkeypatch)
    tests = {"question": ["What is 2+2?", "What is 5-3?", "What is 2*3?"],
             "answer": ["2+2=4\n#### 4", "5-3=2\n#### 2", "2*3=6\n#### 6"]}
    hub_cache.prepared_cache(home, "openai/gsm8k", "main",
                             {"train": tests, "test": tests}, tmp_path)
    snap = home / "hub" / "models--owner--tiny" / "snapshots" / ("a" * 40)
    _hf_folder(snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "grade.yaml").write_text("reward:\n  workers: 0\n")
    assert _run("owner/tiny", "--benchmark", "gsm8k", "-k", "2", "--max-tokens", "4",
                "--batch-size", "4", "--limit", "2", "--config", "grade.yaml") == 0
    report = json.loads((tmp_path / "results-eval" / "owner--tiny" /
                         "gsm8k-limit2_paperx-k2-t1-p0.7.json").read_text())
    assert report["benchmark"]["source"] == "openai/gsm8k"
    assert report["benchmark"]["split"] == "test" and report["benchmark"]["config"] == "main"
    assert report["protocol"]["answer_format"] == "boxed_or_answer_line"
    assert report["questions"] == 2 and report["model"]["ref"] == "owner/tiny"
    m = report["metrics"]
    for prefix in ("greedy_", ""):  # every sample is right, wrong, unanswered or an error
        acc = m["greedy_accuracy"] if prefix else m["avg@2"]
        parts = [m[f"{prefix}{k}"] for k in ("no_answer", "wrong", "grade_error")]
        assert acc + sum(parts) == pytest.approx(100.0)
    assert all(len(q["correct"]) == 2 for q in report["per_question"])
    assert [q["answer"] for q in report["per_question"]] == ["4", "2"]
    assert "gsm8k: openai/gsm8k (main, test), 2 questions" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["tiny", "--benchmark", "gsm9k"], "--benchmark gsm9k: no such benchmark"),
    (["tiny", "--benchmark", "nope/aime.jsonl", "--format", "math"],
     "--benchmark nope/aime.jsonl: no such file"),
    (["tiny", "--benchmark", "grade.yaml"], "give its row format with --format"),
    (["missing", "--benchmark", "aime.jsonl", "--format", "math"],
     "model missing: not a directory"),
    (["tiny", "--limit", "3"], "--limit: only with --benchmark"),
    (["tiny", "--benchmark", "aime.jsonl", "--format", "gsm8k", "--config", "grade.yaml"],
     "data error: aime.jsonl:1"),
])
def test_bad_input_is_one_line(bench_files, argv, message, capsys):
    assert _run(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_score_is_the_held_out_evals_metrics():
    """``score`` on [N, k]: avg@k and pass@k as ``evaluate`` reports them, the SE over
    questions, and reasons split into no answer / wrong / grading errors."""
    correct = np.array([[1, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    reasons = np.array([["ok", "wrong", "no_answer", "ok"], ["ok", "no_answer", "timeout",
                                                             "wrong"], ["wrong"] * 4])
    s = score(correct, reasons=reasons)
    assert pass_ks(4) == (1, 2, 4) and pass_ks(1) == (1,) and pass_ks(6) == (1, 2, 4, 6)
    assert s["avg@4"] == 25.0 and s["pass@4"] == pytest.approx(200 / 3)
    assert s["pass@2"] == pytest.approx(100 * ((1 - 1 / 6) + 0.5) / 3)
    assert s["avg@4_se"] == pytest.approx(100 * standard_error([0.5, 0.25, 0.0]))
    assert s["no_answer"] == pytest.approx(100 * 2 / 12)
    assert s["wrong"] == pytest.approx(100 * 6 / 12)
    assert s["grade_error"] == pytest.approx(100 / 12)
    assert standard_error([1.0]) != standard_error([1.0])  # nan below two questions
    assert standard_error([1, 0, 1, 0]) == pytest.approx(np.sqrt(0.25 * 4 / 3 / 4))


@pytest.mark.parametrize("rows, fmt", [
    ([{"question": "1+2?", "answer": "so 3\n#### 3"}] * 3, "gsm8k"),
    ([{"question": "1+2?", "answer": "3"}], "generic"),
    ([{"question": "1+2?", "answer": "3 (apples)", "body": "b"}], "asdiv"),
    ([{"problem": "1+2?", "answer": "3"}], "math"),
    ([{"prompt": "1+2?", "reward_model": {"ground_truth": "3"}}], "dapo"),
    ([{"Body": "b", "Question": "q", "Answer": 3}], "svamp"),
    ([{"question": "1+2?", "answer": "#### 3"}, {"question": "2+2?", "answer": "4"}], None),
    ([{"q": "1+2?", "a": "3"}], None),
])
def test_the_row_format_is_inferred_only_when_the_fields_say_it(tmp_path, rows, fmt):
    from tppo_jax.cli.eval_benchmark import infer_format

    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert infer_format(path) == fmt


def test_a_gsm8k_file_needs_no_format(bench_files, scripted, capsys):
    rows = [{"question": q["problem"], "answer": f"steps\n#### {q['answer']}"} for q in QUESTIONS]
    (bench_files / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _run("tiny", "--benchmark", "g.jsonl", "--greedy", "--config", "grade.yaml",
                "--out", "g.json") == 0
    assert "rows read as --format gsm8k" in capsys.readouterr().err
    report = json.loads((bench_files / "g.json").read_text())
    assert report["benchmark"]["format"] == "gsm8k"
    assert [q["answer"] for q in report["per_question"]] == ["3", "7", "12"]
