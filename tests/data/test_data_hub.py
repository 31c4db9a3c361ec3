"""Hub dataset ids as ``data.source``, offline: the caches are laid out by ``hub_cache``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from hub_cache import hub_snapshot, offline_home, prepared_cache, subprocess_env

from tppo_jax.config import ConfigError, load_config
from tppo_jax.data.readers import DataError
from tppo_jax.data.sources import is_hub_id, read_source

GSM8K = {
    "train": {"question": ["Natalia sold 48 clips in April and half as many in May. Total?",
                           "A shop sells 1,200 pens a day. How many in 2 days?",
                           "Tom has 3 apples and buys 4. How many now?"],
              "answer": ["48/2 = <<48/2=24>>24 in May.\n48+24 = <<48+24=72>>72\n#### 72",
                         "1200*2=<<1200*2=2400>>2400\n#### 2,400",
                         "3+4=<<3+4=7>>7\n#### 7"]},
    "test": {"question": ["What is 2+2?"], "answer": ["2+2=4\n#### 4"]},
}
MATH500 = {"test": {
    "problem": ["What is $\\frac14+\\frac14$?", "Compute $\\sqrt{16}$."],
    "solution": ["$\\frac14+\\frac14=\\boxed{\\frac{1}{2}}$.", "$\\sqrt{16}=\\boxed{4}$."],
    "answer": ["\\frac{1}{2}", "4"], "subject": ["Prealgebra", "Algebra"], "level": [1, 2],
    "unique_id": ["test/prealgebra/1.json", "test/algebra/2.json"]}}
DAPO = {"train": {
    "data_source": ["math_dapo"] * 2,
    "prompt": [[{"content": "Solve: what is 17 + 17?", "role": "user"}],
               [{"content": "Find m+n where m/n = 0.75.", "role": "user"}]],
    "ability": ["MATH"] * 2,
    "reward_model": [{"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
                     {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"}],
    "extra_info": [{"index": "a1"}, {"index": "b2"}]}}


def expected_gsm8k(split: str) -> list[tuple[str, str]]:
    cols = GSM8K[split]
    return [(q, a.rpartition("####")[2].strip().replace(",", ""))
            for q, a in zip(cols["question"], cols["answer"], strict=True)]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return offline_home(tmp_path / "hf", monkeypatch)


@pytest.mark.parametrize("source, hub", [
    ("openai/gsm8k", True), ("HuggingFaceH4/MATH-500", True),
    ("BytedTsinghua-SIA/DAPO-Math-17k", True), ("synthetic", False), ("rows.jsonl", False),
    ("data/train.parquet", False), ("a/b/c", False), ("/abs/x", False), ("owner/", False)])
def test_what_reads_as_a_hub_id(source: str, hub: bool) -> None:
    assert is_hub_id(source) is hub


def test_gsm8k_from_the_datasets_cache_offline(home: Path, tmp_path: Path) -> None:
    """A user who loaded openai/gsm8k once online: offline, the prepared copy is read."""
    prepared_cache(home, "openai/gsm8k", "main", GSM8K, tmp_path)
    for split in ("train", "test"):
        exs, rep = read_source("openai/gsm8k", format="gsm8k", hf_config="main", split=split)
        assert [(e.question, e.answer) for e in exs] == expected_gsm8k(split)
        assert rep.total_rows == len(exs) and rep.num_bad == 0
    assert exs[0].source == "openai/gsm8k" and exs[0].solution == "2+2=4"


def test_gsm8k_from_the_hub_snapshot_offline(home: Path) -> None:
    """A user with only ``hf download``'s snapshot: read from the hub cache."""
    hub_snapshot(home, "openai/gsm8k", {"main": GSM8K, "socratic": GSM8K})
    exs, _ = read_source("openai/gsm8k", format="gsm8k", hf_config="main", split="train")
    assert [(e.question, e.answer) for e in exs] == expected_gsm8k("train")
    sliced, _ = read_source("openai/gsm8k", format="gsm8k", hf_config="main",
                            split="train[:2]")
    assert [e.answer for e in sliced] == ["72", "2400"]


def test_math500_and_dapo_columns(home: Path) -> None:
    hub_snapshot(home, "HuggingFaceH4/MATH-500", {"default": MATH500})
    hub_snapshot(home, "BytedTsinghua-SIA/DAPO-Math-17k", {"default": DAPO})
    math, _ = read_source("HuggingFaceH4/MATH-500", format="math", split="test")
    assert [(e.question, e.answer, e.id) for e in math] == list(zip(
        MATH500["test"]["problem"], MATH500["test"]["answer"], MATH500["test"]["unique_id"],
        strict=True))
    dapo, _ = read_source("BytedTsinghua-SIA/DAPO-Math-17k", format="dapo",
                          fields={"id": "extra_info.index"})
    assert [(e.question, e.answer, e.id) for e in dapo] == [
        ("Solve: what is 17 + 17?", "34", "a1"), ("Find m+n where m/n = 0.75.", "7", "b2")]


def test_a_bad_row_names_the_id_and_row_or_is_skipped(home: Path) -> None:
    bad = {"train": {"question": ["fine?", "no final line", "fine too?"],
                     "answer": ["1+1=2\n#### 2", "just text", "#### 3"]}}
    hub_snapshot(home, "openai/gsm8k", {"main": bad})
    with pytest.raises(DataError, match=r"^openai/gsm8k \(main, train\):row 1: gsm8k answer"):
        read_source("openai/gsm8k", format="gsm8k", hf_config="main")
    exs, rep = read_source("openai/gsm8k", format="gsm8k", hf_config="main", on_bad_row="skip")
    assert [e.answer for e in exs] == ["2", "3"]
    assert rep.num_bad == 1 and rep.bad[0][0] == "openai/gsm8k (main, train):row 1"


def _one_line_error(**kw) -> str:
    with pytest.raises(DataError) as e:
        read_source(**{"format": "gsm8k", **kw})
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_an_id_that_cannot_be_had_is_one_line(home: Path) -> None:
    msg = _one_line_error(source="nobody/no-such-set")
    assert msg.startswith("nobody/no-such-set (train): not in the local cache") and "offline" in msg


def test_a_missing_split_lists_the_splits(home: Path, tmp_path: Path) -> None:
    hub_snapshot(home, "HuggingFaceH4/MATH-500", {"default": MATH500})
    msg = _one_line_error(source="HuggingFaceH4/MATH-500", split="train")
    assert "no split 'train'; its splits: test (set data.split)" in msg, msg
    prepared_cache(home, "openai/gsm8k", "main", GSM8K, tmp_path)
    msg = _one_line_error(source="openai/gsm8k", hf_config="main", split="validation")
    assert msg.startswith("openai/gsm8k (main, validation): no split 'validation'; its splits: "
                          "train, test"), msg


def test_a_config_to_choose_is_one_line(home: Path) -> None:
    hub_snapshot(home, "openai/gsm8k", {"main": GSM8K, "socratic": GSM8K})
    msg = _one_line_error(source="openai/gsm8k")
    assert "main" in msg and "socratic" in msg and "data.hf_config" in msg, msg


def test_a_local_path_wins_over_the_id(home: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    hub_snapshot(home, "openai/gsm8k", {"main": GSM8K})
    monkeypatch.chdir(tmp_path)
    local = {"question": ["local?"], "answer": ["#### 9"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(local)}).save_to_disk(
        "openai/gsm8k")
    exs, _ = read_source("openai/gsm8k", format="gsm8k", hf_config="main")
    assert [(e.question, e.answer) for e in exs] == [("local?", "9")]
    assert "its splits: train" in _one_line_error(source="openai/gsm8k", split="test")


def test_a_saved_dataset_folder(tmp_path: Path) -> None:
    datasets.Dataset.from_dict(GSM8K["test"]).save_to_disk(str(tmp_path / "one"))
    exs, _ = read_source(str(tmp_path / "one"), format="gsm8k", split="ignored-for-one-split")
    assert [(e.question, e.answer) for e in exs] == expected_gsm8k("test")


def test_a_file_source_still_reads_and_a_missing_one_says_so(tmp_path: Path) -> None:
    p = tmp_path / "rows.jsonl"
    p.write_text(json.dumps({"question": "q?", "answer": "#### 5"}) + "\n")
    exs, _ = read_source(str(p), format="gsm8k", split="test")
    assert [e.answer for e in exs] == ["5"]
    assert "no such file" in _one_line_error(source=str(tmp_path / "nope.jsonl"))
    assert "no such file" in _one_line_error(source="synthtic")


def test_tppo_data_preview_reads_an_id(home: Path, tmp_path: Path, capsys) -> None:
    from tppo_jax.cli import main

    prepared_cache(home, "openai/gsm8k", "main", GSM8K, tmp_path)
    over = ["data.source=openai/gsm8k", "data.hf_config=main", "data.format=gsm8k",
            "data.eval_size=1"]
    assert main(["data", "preview", *over, "-n", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["answer"] == "72"
    assert main(["data", "preview", *over, "data.split=dev"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no split 'dev'; its splits: train, test" in err, err


@pytest.mark.parametrize("over, ok", [
    ("data.split=train[:1000]", True), ("data.split=train[10%:]+test", True),
    ("data.split=''", False), ("data.split='train test'", False),
    ("data.hf_config=main", True), ("data.hf_config=''", False),
    ("data.hf_config=' main'", False), ("data.hf_revision=v1.0", True),
    ("data.hf_revision=''", False)])
def test_config_checks_the_names(over: str, ok: bool) -> None:
    if ok:
        load_config(None, [over])
    else:
        with pytest.raises(ConfigError, match=over.split("=")[0]):
            load_config(None, [over])


def test_the_warmstart_key_ignores_hub_keys_for_synthetic_data() -> None:
    from tppo_jax.weights.warmstart import warmstart_key

    base = warmstart_key(load_config(None))
    assert base == warmstart_key(load_config(None, ["data.split=test", "data.hf_config=x"]))
    # The warm-start trains on the synthetic task's teacher corpus whatever the rows: a
    # table source (and its split) shares the synthetic task's warm-start (issue 49 L8).
    hub = ["data.source=openai/gsm8k", "data.format=gsm8k"]
    assert warmstart_key(load_config(None, hub)) == warmstart_key(
        load_config(None, [*hub, "data.split=test"])) == base


def test_a_fresh_process_honours_hf_home_and_offline(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment variables themselves (not patched constants) pick the cache."""
    home = tmp_path / "hf"
    with monkeypatch.context() as m:
        offline_home(home, m)
        hub_snapshot(home, "openai/gsm8k", {"main": GSM8K})
    code = ("from tppo_jax.data.sources import read_source\n"
            "exs, _ = read_source('openai/gsm8k', format='gsm8k', hf_config='main')\n"
            "print([e.answer for e in exs])\n")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(home), text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['72', '2400', '7']"
