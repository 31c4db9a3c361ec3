"""What a notebook user types, offline: `tppo train` with the model and the data given as
Hub ids (read from an HF cache the test lays out, `HF_HUB_OFFLINE=1`), LoRA adapters and W&B
in offline mode; the run trains, keeps the ids in its config.yaml, logs the same steps to
metrics.jsonl and W&B, and `tppo eval --benchmark` scores it on a Hub dataset's test split."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))  # the offline cache builders

from hub_cache import hub_snapshot, offline_home  # noqa: E402

from tppo_jax.cli import main  # noqa: E402
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.tokenizer import train_sentencepiece

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"
COMMIT = "c" * 40


def _model_cache(home: Path) -> None:
    root = home / "hub" / "models--owner--tiny"
    snap = root / "snapshots" / COMMIT
    shutil.copytree(FIXTURE, snap, ignore=shutil.ignore_patterns("*.npz", "greedy.json"))
    # the fixture's whole vocabulary (256), so every id the model samples decodes
    train_sentencepiece(SyntheticMathTask(seed=0).teacher_corpus(2000, 0.0, 0.0),
                        snap / "tokenizer", vocab_size=256)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)


def _rows(n: int, offset: int) -> dict[str, list[str]]:
    qs = [(i % 4 + 1, i % 3 + 1) for i in range(offset, offset + n)]
    return {"question": [f"{a} + {b} = ?" for a, b in qs],
            "answer": [f"{a} + {b} = {a + b}\n#### {a + b}" for a, b in qs]}


@pytest.mark.slow
def test_hub_model_and_dataset_with_lora_and_wandb_train_offline(tmp_path, monkeypatch,
                                                                 wandb_offline):
    home = offline_home(tmp_path / "hf", monkeypatch)
    _model_cache(home)
    hub_snapshot(home, "owner/sums", {"main": {"train": _rows(48, 0), "test": _rows(8, 100)}})
    monkeypatch.chdir(tmp_path)  # "owner/tiny" and "owner/sums" are no local paths here
    run = tmp_path / "runs" / "hub"
    overrides = ["model.source=hf", "model.path=owner/tiny", "model.max_seq_len=224",
                 "model.lora_rank=4", "data.source=owner/sums", "data.hf_config=main",
                 "data.format=gsm8k", "data.eval_size=8", "rollout.max_prompt_len=128",
                 "rollout.max_response_len=32", "rollout.window=16", "train.steps=2",
                 "train.eval_samples=1", "checkpoint.every=2", "logging.tensorboard=false",
                 "logging.wandb=true", "logging.wandb_project=hub-e2e", "train.compile_cache=",
                 "reward.workers=1"]
    assert main(["train", "--config", "smoke", "--run-dir", str(run), "--no-progress",
                 *overrides]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    saved = (run / "config.yaml").read_text()
    assert "path: owner/tiny\n" in saved and "source: owner/sums\n" in saved
    assert (run / "wandb_id").read_text().strip()
    assert list(wandb_offline.rglob("*.wandb"))

    out = tmp_path / "bench.json"
    assert main(["eval", "--benchmark", "owner/sums", str(run), "--format", "gsm8k",
                 "--split", "test", "-k", "2", "--max-tokens", "16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["per_question"]) == 8
