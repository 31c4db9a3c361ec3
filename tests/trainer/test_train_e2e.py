"""`tppo train` end to end on the smoke config: real tokenizer training, warm-start, T-PPO
steps with math-verify grading, Orbax checkpoints, metrics; then `--resume` continues."""

import json
import os
import subprocess
import sys

import pytest


def _tppo(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "tppo_jax.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_smoke_train_then_resume(tmp_path):
    run = tmp_path / "runs" / "smoke"
    # 16 held-out questions (the config's 128 make every eval below, in-run and `tppo eval`,
    # the bulk of the test's time); the evals of the run read it from the run's config.
    r = _tppo("train", "--config", "smoke", "--run-dir", str(run), "--no-progress",
              "data.eval_size=16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out accuracy" in r.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    for key in ("reward_mean", "policy_loss", "value_loss", "wall_time", "occupancy"):
        assert key in rows[0]
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == ["2", "4"]
    for item in ("policy", "value", "policy_opt", "value_opt", "slots", "meta",
                 "manifest.json"):
        assert (run / "checkpoints" / "4" / item).exists()
    # The run keeps its own warm-start (tokenizer + weights): a copied run dir needs no cache.
    assert all((run / "warmstart" / f).exists() for f in ("DONE", "tokenizer.model", "policy"))
    assert list((run / "tensorboard").iterdir())
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion", "answer", "reward", "reason"} <= set(
        samples[0])
    assert samples[0]["prompt"].startswith("Q: ")  # the tiny model's own prompt format
    # The warm-start is cached next to the run dir, so it is reused on resume.
    assert len(list((tmp_path / "runs").glob("warmstart-*/DONE"))) == 1

    # Without --resume an existing run dir is refused with a one-line reason.
    r = _tppo("train", "--config", "smoke", "--run-dir", str(run), cwd=tmp_path)
    assert r.returncode == 2 and "--resume" in r.stderr

    r = _tppo("train", "--config", "smoke", "--run-dir", str(run), "--resume", "--no-progress",
              "data.eval_size=16", "train.steps=6", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warm-start (SFT)" not in r.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5, 6]

    # The run's tools: plots, evaluation, HF export (loadable by from_pretrained).
    r = _tppo("plot", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "metrics_vs_step.png").stat().st_size > 1000
    r = _tppo("eval", str(run), "--show", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("=== prompt\nQ: ") == 2 and "--- completion" in r.stdout
    res = json.loads((run / "eval_6_run-k4-t1-p1.json").read_text())
    k = res["k"]
    # A line a person reads, and where the report went (the JSON holds the rest)
    assert f"step 6: {res['questions']} held-out questions, run protocol" in r.stdout
    assert f"avg@{k} {res[f'avg@{k}']:.1f}%" in r.stdout
    assert r.stdout.rstrip().endswith(f"wrote {run / 'eval_6_run-k4-t1-p1.json'}")
    assert 0.0 <= res[f"avg@{k}"] <= res[f"pass@{k}"] <= 100.0 and res["questions"] > 0
    # The default protocol is the run's: `tppo eval` reproduces the in-run held-out eval.
    after = json.loads((run / "summary.json").read_text())["eval_after"]
    assert res["protocol"]["name"] == "run" and f"avg@{k}" in after
    assert (res[f"avg@{k}"], res[f"pass@{k}"]) == (after[f"avg@{k}"], after[f"pass@{k}"])
    # --start scores the policy the run started from: its greedy answers are the ones the
    # eval before training graded, question by question.
    r = _tppo("eval", str(run), "--start", "--greedy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    start = json.loads((run / "eval_start_greedy.json").read_text())
    before = json.loads((run / "summary.json").read_text())["eval_before"]
    assert start["start"] and start["step"] == 0
    assert start["correct_mask"] == before["greedy_correct_mask"]
    r = _tppo("eval", str(run), "--protocol", "paper", "-k", "2", "--out",
              str(tmp_path / "paper.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    paper = json.loads((tmp_path / "paper.json").read_text())
    assert {k: paper["protocol"][k] for k in ("name", "samples", "temperature", "top_p")} == {
        "name": "paper+", "samples": 2, "temperature": 1.0, "top_p": 0.7}
    r = _tppo("export", str(run), str(tmp_path / "hf"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    from tppo_jax.models.hf import from_pretrained
    from tppo_jax.models.tokenizer import Tokenizer

    model = from_pretrained(tmp_path / "hf")
    tok = Tokenizer.load(tmp_path / "hf")
    hf_tok = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert hf_tok["tokenizer_class"] == "LlamaTokenizer" and hf_tok["eos_token"] == "</s>"
    assert model.config.vocab_size == tok.vocab_size

    # Numerical fault injection: NaN advantages/returns from step 2 on. Every such update is
    # skipped (params unchanged, so checkpoints stay finite) and the third in a row stops
    # the run with a clear error.
    bad = tmp_path / "runs" / "nan"
    r = _tppo("train", "--config", "smoke", "--run-dir", str(bad), "--no-progress",
              "train.steps=8", "checkpoint.every=1", "data.eval_size=16", cwd=tmp_path,
              env={"TPPO_FAULT_NAN_FROM_STEP": "2"})
    assert r.returncode == 1, r.stderr[-2000:]
    assert "non-finite loss or gradient in 3 consecutive steps" in r.stderr
    rows = [json.loads(x) for x in (bad / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert rows[0]["policy_skipped"] == 0 and rows[-1]["policy_skipped"] > 0
    # The stop names the last checkpoint to go back to.
    assert "last checkpoint: step" in r.stderr
