"""`tppo export` writes the ids that end a generation: transformers' ``generate`` reads BOS /
EOS / pad from ``config.json`` and ``generation_config.json``, not from the tokenizer, so an
export without them never stopped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tppo_jax.cli import main
from tppo_jax.config import load_config
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.hf import write_special_ids
from tppo_jax.models.tokenizer import Tokenizer, train_sentencepiece

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Tokenizer]:
    """A run dir over the tiny Qwen2 fixture (sentencepiece tokenizer beside it), exported."""
    tmp = tmp_path_factory.mktemp("export")
    base = tmp / "base"
    shutil.copytree(FIXTURE, base)
    tok = train_sentencepiece(SyntheticMathTask(seed=0).teacher_corpus(200, 0.0, 0.0),
                              base / "tokenizer", vocab_size=64)
    cfg = load_config(None, ["model.source=hf", f"model.path={base}", "model.max_seq_len=224"])
    run = tmp / "runs" / "hf"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    assert main(["export", str(run), str(tmp / "hf"), "--start"]) == 0
    return tmp / "hf", tok


def test_export_names_bos_eos_pad(exported) -> None:
    out, tok = exported
    assert tok.eos_ids and tok.bos_id is not None
    config = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    for d in (config, gen):
        assert d["bos_token_id"] == tok.bos_id
        assert d["eos_token_id"] == tok.eos_ids[0]
        assert d["pad_token_id"] == tok.pad_id
    assert config["model_type"] == "qwen2"  # the model's own keys are kept
    assert Tokenizer.load(out).eos_ids == tok.eos_ids


def test_transformers_generate_stops_on_export(exported) -> None:
    transformers = pytest.importorskip("transformers")
    out, tok = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    gen = model.generation_config
    assert gen.eos_token_id == tok.eos_ids[0] and gen.pad_token_id == tok.pad_id
    assert model.config.bos_token_id == tok.bos_id


def test_write_special_ids_merges_and_lists_every_eos(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7,
                                                                 "eos_token_id": 2}))
    write_special_ids(tmp_path, bos_id=None, eos_ids=(2, 151645), pad_id=2)
    config = json.loads((tmp_path / "config.json").read_text())
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert config == {"model_type": "llama", "eos_token_id": [2, 151645], "pad_token_id": 2}
    assert gen == {"temperature": 0.7, "eos_token_id": [2, 151645], "pad_token_id": 2}
