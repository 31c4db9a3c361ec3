"""A LoRA run of a real model, exported, and read back by ``transformers``.

Trains ``--steps`` T-PPO steps of ``--config`` (default: the SmolLM2-135M GGUF config) with
``model.lora_rank=R``, then checks what ``tppo export`` wrote against the run's own
adapter forward (adapters apart, not merged), on the chat-templated held-out prompts:

- ``merged_vs_adapters``: our loader's logits of the merged HF folder;
- ``transformers_vs_adapters``: ``AutoModelForCausalLM`` on the same folder (float32), in
  ``--torch-python`` (a Python with torch + transformers; default: this one, when it has
  them) -- transformers is not a dependency of this project;
- ``peft_rule_vs_merged``: ``W + alpha/r B A`` from ``OUT/adapter`` on the base's HF
  weights (``tppo convert`` of the GGUF), tensor by tensor, against the merged weights;
- ``transformers_generate``: greedy tokens of transformers' ``generate`` on the export against
  the rollout engine's on the run's adapters, and whether it stopped on the exported EOS ids.

    tppo bench lora-export --torch-python /path/to/venv/bin/python

Writes ``results/lora_export_<config>.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

GREEDY_TOKENS = 64  # the SmolLM2 config's L
# Run in --torch-python: logits and greedy tokens of the exported folder under transformers.
_TRANSFORMERS = r"""
import json, sys
import numpy as np, torch, transformers
folder, ids_file, out = sys.argv[1:4]
rows = json.loads(open(ids_file).read())
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
logits, greedy = [], []
with torch.no_grad():
    for ids in rows:
        x = torch.tensor([ids])
        logits.append(model(x).logits[0].numpy())
        g = model.generate(x, max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, len(ids):]
        greedy.append(g.tolist())
np.savez(out, *logits)
json.dump({"greedy": greedy, "version": transformers.__version__,
           "eos": model.generation_config.eos_token_id}, open(out + ".json", "w"))
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="smollm2_gsm8k_cpu")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts compared")
    p.add_argument("--runs", default="runs/lora-export", help="the run dir and exports")
    p.add_argument("--torch-python", default=sys.executable,
                   help="a Python with torch and transformers")
    p.add_argument("--out", default="results")
    p.add_argument("--reuse", action="store_true", help="check the finished run in --runs")
    p.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE for the run")


def _train(args: argparse.Namespace, run_dir: Path) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "tppo_jax.cli", "train", "--config", args.config,
           "--run-dir", str(run_dir), "--no-progress", f"model.lora_rank={args.rank}",
           f"train.steps={args.steps}", f"checkpoint.every={args.steps}", "data.eval_size=4",
           "train.eval_samples=1", *args.overrides]
    print("[lora-export]", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def _ours(run_dir: Path, n: int) -> tuple[list[list[int]], list[np.ndarray], list[list[int]],
                                          dict]:
    """Held-out prompt ids, the run's adapter-forward logits and greedy tokens (through the
    rollout engine, as the held-out eval decodes)."""
    import jax.numpy as jnp

    from tppo_jax.data.prompts import prompt_builder
    from tppo_jax.data.run_data import load_data
    from tppo_jax.eval.heldout import generate_answers
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.weights.restore import policy_from_run

    got = policy_from_run(run_dir, merge_lora=False)
    cfg, tok, policy, step = got.cfg, got.tokenizer, got.model, got.step
    assert policy.backbone.layers.attn.lora is not None, "adapters were merged"
    prompter = prompt_builder(cfg, tok)
    rows = [prompter.ids(e, tok) for e in load_data(cfg)[1][:n]]
    logits = [np.asarray(policy(jnp.asarray([ids]))[0]) for ids in rows]
    # The engine that trains and evaluates decodes the adapters as they are (not merged).
    greedy = generate_answers(policy, tok, rows, max_prompt_len=max(map(len, rows)),
                              max_response_len=GREEDY_TOKENS, sampling=SamplingParams(greedy=True),
                              batch_size=len(rows))
    return rows, logits, greedy, {"step": step, "lora_rank": cfg.model.lora_rank,
                                  "lora_alpha": cfg.model.lora_alpha, "eos_ids": tok.eos_ids,
                                  "source": cfg.model.source, "path": cfg.model.path}


def _peft_rule(base: Path, export: Path, alpha: float) -> float:
    """Max |W + alpha/r B A - W_merged| over the exported tensors."""
    from safetensors.numpy import load_file

    lora = load_file(export / "adapter" / "adapter_model.safetensors")
    merged = load_file(export / "model.safetensors")
    worst = 0.0
    for name, w in load_file(base / "model.safetensors").items():
        pre = f"base_model.model.{name.removesuffix('.weight')}."
        if pre + "lora_A.weight" in lora:
            a, b = lora[pre + "lora_A.weight"], lora[pre + "lora_B.weight"]
            w = w + (alpha / a.shape[0]) * (b @ a)
        worst = max(worst, float(np.abs(w - merged[name]).max()))
    return worst


def _tppo(*argv: str) -> None:
    """``tppo ARGV`` as users run it (a process of its own: the package never imports its
    CLI); a failure stops the benchmark."""
    subprocess.run([sys.executable, "-m", "tppo_jax.cli", *argv], check=True)


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.models.hf import from_pretrained

    runs = Path(args.runs)
    run_dir, export, base = runs / "run", runs / "export", runs / "base"
    reuse = args.reuse and (run_dir / "summary.json").exists()
    wall_s = None if reuse else _train(args, run_dir)
    rows, ours, greedy, meta = _ours(run_dir, args.prompts)
    _tppo("export", str(run_dir), str(export))
    merged = from_pretrained(export)
    summary = json.loads((run_dir / "summary.json").read_text())
    out: dict = {"config": args.config, "steps": summary["steps"],
                 "train_seconds": summary["train_seconds"], "run_wall_s": wall_s, **meta,
                 "prompts": len(rows)}
    out["merged_vs_adapters"] = max(
        float(np.abs(np.asarray(merged(np.asarray([ids]))[0]) - lg).max())
        for ids, lg in zip(rows, ours, strict=True))
    if meta["source"] == "gguf":  # the base as HF weights, for PEFT's rule
        _tppo("convert", meta["path"], str(base))
        out["peft_rule_vs_merged"] = _peft_rule(base, export, meta["lora_alpha"])
    ids_file = runs / "ids.json"
    ids_file.write_text(json.dumps(rows))
    got = runs / "transformers"
    # Run outside the checkout: its top-level kernels/ would shadow the PyPI package of that
    # name that transformers probes for.
    probe = subprocess.run([args.torch_python, "-c",
                            _TRANSFORMERS.replace("GREEDY_TOKENS", str(GREEDY_TOKENS)),
                            str(export.resolve()),
                            str(ids_file.resolve()), str(got.resolve())], capture_output=True,
                           text=True, cwd=runs)
    if probe.returncode:
        out["transformers"] = f"not run: {probe.stderr.strip().splitlines()[-1]}"
    else:
        theirs = np.load(f"{got}.npz")
        info = json.loads(Path(f"{got}.json").read_text())
        out["transformers"] = info["version"]
        out["transformers_vs_adapters"] = max(
            float(np.abs(theirs[f"arr_{i}"] - lg).max()) for i, lg in enumerate(ours))
        eos = set(meta["eos_ids"])
        out["transformers_generate"] = {
            "same_greedy_tokens": sum(a == b for a, b in zip(info["greedy"], greedy,
                                                                strict=True)),
            "stopped_on_eos": sum(bool(g) and g[-1] in eos for g in info["greedy"]),
            "of": len(rows)}
    out["logit_scale"] = float(max(np.abs(lg).max() for lg in ours))
    dest = Path(args.out) / f"lora_export_{Path(args.config).stem}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return out
