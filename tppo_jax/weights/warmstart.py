"""Supervised warm-start of the tiny CPU-default policy: tokenizer + SFT on a teacher corpus.

RL sharpens skills a model already has; it does not teach arithmetic in minutes. So the
base policy is trained on a *noisy* teacher corpus (a known fraction of solutions make a
wrong step or drop the ``\\boxed{}`` format): it learns the procedure but samples wrong or
unformatted answers often, which the reward can then fix. The result (tokenizer +
HF-format weights) is cached by a hash of everything that affects it, so a second run
skips it, and copied into the run directory (``RUN/warmstart/``): a run directory moved,
copied or read back from a bucket resumes, evaluates and exports without the cache.

The shipped configs' warm-starts come with the package (``tppo_jax/warmstarts/``, each the
files of its cache folder): a config whose key matches one starts from it instead
of training, so the first run of the default spends its minutes on RL. Regenerated (and
checked) by ``python -m tppo_jax.weights.warmstart [--check] default longtail``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from tppo_jax.config import Config, DataConfig, RolloutConfig
from tppo_jax.data.prompts import SHORT_ANSWER_CUE
from tppo_jax.data.run_data import synthetic_task
from tppo_jax.models.hf import from_pretrained, save_pretrained
from tppo_jax.models.tokenizer import Tokenizer, train_sentencepiece
from tppo_jax.models.transformer import ModelConfig, Transformer, create_model
from tppo_jax.weights.params import model_key

log = logging.getLogger(__name__)

RUN_SUBDIR = "warmstart"  # the run directory's own copy of its warm-start

# The shipped warm-starts: a folder per key named as its cache folder ("warmstart-<key>": not
# a Python identifier, so setuptools ships it as the package's data), holding what ``_train``
# writes to a cache.
SHIPPED = Path(__file__).resolve().parents[1] / "warmstarts"
SHIPPED_CONFIGS = ("default", "longtail")  # the configs whose warm-starts ship
# A cache folder's files, as ``_train`` writes them (DONE last).
CACHE_FILES = ("tokenizer.model", "tokenizer.vocab", "policy/config.json",
               "policy/model.safetensors", "stats.json", "DONE")

TEACHER_SIZE = 20000
WIDTH_BUCKET = 32  # SFT batches are padded to a multiple of this many tokens


def warmstart_key(cfg: Config) -> str:
    """The warm-start's cache key: a hash of every setting that changes its tokenizer or
    weights (``data.on_bad_row`` does not: it is hashed as its default, so a resume may
    change it without a new warm-start)."""
    return _key(cfg, DataConfig.on_bad_row)


def accepted_keys(cfg: Config) -> tuple[str, ...]:
    """Keys a finished warm-start for ``cfg`` may carry: ``warmstart_key`` and, for a
    config with another ``data.on_bad_row``, the key earlier versions gave it (they hashed
    the setting as given), so those runs' own copies and caches stay valid."""
    keys = (warmstart_key(cfg), _key(cfg, cfg.data.on_bad_row))
    return tuple(dict.fromkeys(keys))


# Where a Hub or folder table comes from (data/sources.py). At their defaults, and always for
# the synthetic task (which ignores them), they stay out of cache keys: the keys of configs
# that predate them stay valid.
SOURCE_KEYS = ("hf_config", "split", "hf_revision")


def keyed_data(cfg: Config) -> dict[str, Any]:
    """``cfg.data`` as cache keys hash it (``SOURCE_KEYS`` dropped where they change
    nothing)."""
    defaults = DataConfig()
    synthetic = cfg.data.source == "synthetic"
    return {k: v for k, v in asdict(cfg.data).items()
            if not (k in SOURCE_KEYS and (synthetic or v == getattr(defaults, k)))}


# The data settings the warm-start reads: the synthetic task's (its teacher corpus trains
# the tokenizer and the model, whatever rows the run trains on).
TASK_KEYS = ("seed", "difficulty", "max_operand", "max_value", "max_steps", "style")


def _key(cfg: Config, on_bad_row: str) -> str:
    t = cfg.train
    if cfg.data.source != "synthetic":  # the same warm-start as the synthetic task's
        task = {k: getattr(cfg.data, k) for k in TASK_KEYS}
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(DataConfig(), **task))
    # The batching joins the key only when it is not the original "random", so the caches
    # (and README's keys) of configs that predate it stay valid.
    batching = [] if t.warmstart_batching == "random" else [t.warmstart_batching]
    # The corpus rows are cut at a rollout row's length (``rollout.max_len``), which changes
    # the weights (the default task has rows longer than its 224); it joins the key when it
    # is not the library default's, so the shipped warm-start's key stays what it was.
    length = cfg.rollout.max_len
    cut = [] if length == RolloutConfig().max_len else [length]
    # The held-out set's size does not change the teacher corpus (the synthetic task's train
    # split), so a bigger eval does not retrain the warm-start.
    data = {k: v for k, v in keyed_data(cfg).items()
            if not (k == "eval_size" and cfg.data.source == "synthetic")}
    data["on_bad_row"] = on_bad_row
    # The warm-start trains in float32 whatever model.dtype (it stands in for a pretrained
    # checkpoint; a bfloat16 run reads it cast, as it would a bfloat16 HF folder).
    model = {**model_key(cfg, with_lora=False), "dtype": "float32"}
    model.pop("param_dtype", None)
    blob = json.dumps({"model": model, "data": data,
                       "train": [t.warmstart_steps, t.warmstart_lr, t.warmstart_batch,
                                 *batching, *cut],
                       "teacher": [cfg.train.warmstart_wrong_step_frac,
                                   cfg.train.warmstart_no_format_frac, TEACHER_SIZE],
                       # v4: daily lines read "day k of n:"
                       "v": 4 if cfg.data.style == "daily" else 3},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_model_config(cfg: Config, vocab_size: int) -> ModelConfig:
    m = cfg.model
    return ModelConfig(vocab_size=vocab_size, hidden_size=m.hidden_size,
                       intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                       num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                       head_dim=m.hidden_size // m.num_heads, max_position_embeddings=m.max_seq_len,
                       tie_embeddings=True, dtype=m.dtype, attention=m.attention)


def encode_corpus(tok: Tokenizer, texts: list[str], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``[N, seq_len]`` (with EOS, right-padded) and loss masks over the answer."""
    ids = np.zeros((len(texts), seq_len), np.int32)
    mask = np.zeros((len(texts), seq_len), np.float32)
    for i, t in enumerate(texts):
        prompt, cue, solution = t.partition(SHORT_ANSWER_CUE)
        head = tok.encode(prompt + cue)  # the ids a rollout's prompt has
        row = tok.encode(t)
        # Train on what the policy will continue from. Where the text's own encoding merges
        # the cue's trailing space into the solution's first piece ("A:", "_day"), the
        # prompt as encoded alone ends in a lone "_" that the model would never have seen
        # followed by a solution; then the solution is encoded on its own after it.
        if row[:len(head)] != head:
            row = head + tok.encode(solution)
        row = (row + [tok.eos_id])[:seq_len]
        ids[i, :len(row)] = row
        mask[i, len(head):len(row)] = 1.0  # train on the solution (and its EOS) only
    return ids, mask


def batch_rows(rng: np.random.Generator, lengths: np.ndarray, bs: int, *,
               by_length: bool) -> np.ndarray:
    """``bs`` row indices into a corpus of ``lengths`` ``[N]`` (tokens per row).

    ``by_length``: pick one ``WIDTH_BUCKET``-wide length bucket with probability proportional
    to its row count, then ``bs`` rows uniformly inside it. Each row's chance per draw stays
    ``1/N`` (as with uniform draws), but a batch's rows share a padded width: on long-tailed
    lengths a batch costs its bucket's width, not the corpus tail's.
    """
    if not by_length:
        return rng.integers(0, len(lengths), size=bs)
    bucket = np.asarray(lengths) // WIDTH_BUCKET
    rows = rng.integers(0, len(bucket))  # a bucket chosen in proportion to its size
    members = np.flatnonzero(bucket == bucket[rows])
    return members[rng.integers(0, len(members), size=bs)]


@nnx.jit
def _sft_step(model: Transformer, opt: nnx.Optimizer, ids: jax.Array, mask: jax.Array):
    def loss_fn(m: Transformer):
        logits = m(ids[:, :-1], attention_mask=(ids[:, :-1] != 0) | (mask[:, :-1] > 0))
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        w = mask[:, 1:]
        return (nll * w).sum() / jnp.maximum(w.sum(), 1.0)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


def shipped(cfg: Config) -> Path | None:
    """The package's own warm-start for ``cfg`` (``SHIPPED/warmstart-<key>``), None when none
    ships."""
    folders = (SHIPPED / f"warmstart-{k}" for k in accepted_keys(cfg))
    return next((f for f in folders if (f / "DONE").is_file()), None)


def cached(cfg: Config, cache_root: Path, *, progress: bool = True) -> Path:
    """The shared cache folder of ``cfg``'s warm-start: copied from the package's shipped
    one when its key matches, else trained first if missing."""
    caches = [Path(cache_root) / f"warmstart-{k}" for k in accepted_keys(cfg)]
    done = next((c for c in caches if (c / "DONE").exists()), None)
    if done is not None:
        log.info("warm-start: reusing %s", done)
        return done
    ship = shipped(cfg)
    if ship is not None:
        cache = Path(cache_root) / ship.name
        log.info("warm-start: the shipped one (%s), copied to %s", ship, cache)
        _copy_files(ship, cache)
        return cache
    _train(cfg, caches[0], progress)
    return caches[0]


def _copy_files(src: Path, dst: Path) -> None:
    """A finished warm-start's ``CACHE_FILES`` from ``src`` into ``dst``, ``DONE`` last."""
    for name in CACHE_FILES:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name, dst / name)


def warmstart(cfg: Config, cache_root: Path, *, progress: bool = True, mesh=None
              ) -> tuple[Tokenizer, Transformer, Path]:
    """Returns ``(tokenizer, policy, cache_dir)``, training them unless cached. The policy
    is read back from the cache, straight into its shards when a mesh is given."""
    cache = cached(cfg, cache_root, progress=progress)
    return (*_load(cfg, cache, mesh), cache)


def _load(cfg: Config, folder: Path, mesh) -> tuple[Tokenizer, Transformer]:
    tok = Tokenizer.load(folder / "tokenizer.model")
    return tok, from_pretrained(folder / "policy", dtype=cfg.model.dtype, mesh=mesh)


def run_copy(cfg: Config, run_dir: Path) -> Path | None:
    """The run directory's own finished warm-start for ``cfg`` (None when it has none)."""
    own = Path(run_dir) / RUN_SUBDIR
    try:
        key = json.loads((own / "DONE").read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return own if key in accepted_keys(cfg) else None


def copy_into_run(cfg: Config, cache: Path, run_dir: Path) -> Path:
    """Copies a finished warm-start into ``RUN/warmstart/`` (``DONE`` last, naming its
    key), replacing an older one made for another config."""
    own = Path(run_dir) / RUN_SUBDIR
    if own.exists():
        shutil.rmtree(own)
    tmp = own.with_name(f"{RUN_SUBDIR}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(cache, tmp, ignore=shutil.ignore_patterns("DONE"))
    tmp.rename(own)
    (own / "DONE").write_text(json.dumps({"key": warmstart_key(cfg), "copied_from": str(cache)}))
    return own


def run_warmstart(cfg: Config, run_dir: Path, *, progress: bool = True, mesh=None
                  ) -> tuple[Tokenizer, Transformer, Path]:
    """``(tokenizer, policy, folder)`` of a run: its own copy when it has one (a moved or
    copied run never repeats the warm-start), else the shared cache beside the run dir
    (trained if missing), copied into the run dir by process 0. A host that does not
    share the run dir's disk trains the same seeded model itself."""
    from tppo_jax.parallel import multihost as mh

    run_dir = Path(run_dir)
    if run_copy(cfg, run_dir) is None and mh.is_primary():
        cache = cached(cfg, run_dir.parent, progress=progress)
        run_dir.mkdir(parents=True, exist_ok=True)
        copy_into_run(cfg, cache, run_dir)
    mh.barrier("warmstart")
    own = run_copy(cfg, run_dir)
    if own is not None:
        log.info("warm-start: using the run's own copy in %s", own)
        return (*_load(cfg, own, mesh), own)
    return warmstart(cfg, run_dir.parent, progress=False, mesh=mesh)


def _train(cfg: Config, cache: Path, progress: bool) -> None:
    """Tokenizer + SFT on the noisy teacher corpus, saved to ``cache`` (``DONE`` last)."""
    done = cache / "DONE"
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log.info("warm-start: training the tokenizer and %d SFT steps into %s",
             cfg.train.warmstart_steps, cache)
    task = synthetic_task(cfg)
    texts = task.teacher_corpus(TEACHER_SIZE, cfg.train.warmstart_wrong_step_frac,
                                cfg.train.warmstart_no_format_frac)
    tok = train_sentencepiece(texts, cache / "tokenizer", vocab_size=128)
    ids, mask = encode_corpus(tok, texts, cfg.rollout.max_len)
    mcfg = dataclasses.replace(tiny_model_config(cfg, tok.vocab_size), dtype="float32")
    # Seeded by data.seed, not train.seed: RL runs with different seeds share one base model.
    model = create_model(mcfg, seed=cfg.data.seed)
    opt = nnx.Optimizer(model, optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, cfg.train.warmstart_lr, 50, max(cfg.train.warmstart_steps, 51))), wrt=nnx.Param)
    rng = np.random.default_rng(cfg.data.seed)
    bs = cfg.train.warmstart_batch
    bar = tqdm(range(cfg.train.warmstart_steps), desc="warm-start (SFT)", disable=not progress,
               dynamic_ncols=True)
    loss = float("nan")
    lengths = (ids != 0).sum(axis=1)
    for i in bar:
        idx = batch_rows(rng, lengths, bs, by_length=cfg.train.warmstart_batching == "by_length")
        # Trim the batch to its longest row: most rows are short (long-tailed lengths).
        # Bucketed to multiples of 32 so only a few shapes ever compile.
        width = int(lengths[idx].max()) + 1
        width = min(ids.shape[1], -(-width // WIDTH_BUCKET) * WIDTH_BUCKET)
        loss = _sft_step(model, opt, jnp.asarray(ids[idx, :width]),
                         jnp.asarray(mask[idx, :width]))
        if i % 20 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}")
    save_pretrained(model, cache / "policy")
    (cache / "stats.json").write_text(json.dumps(
        {"final_loss": float(loss), "seconds": time.time() - t0, "vocab": tok.vocab_size,
         "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))}))
    done.write_text("ok")


def ship(names: list[str], check: bool, source: Path | None = None) -> int:
    """Trains each named config's warm-start afresh (no cache, nothing shipped read), or
    takes the finished one in ``source/warmstart-<key>``, and writes it to
    ``SHIPPED/warmstart-<key>``; with ``check``, compares it with the shipped files byte for
    byte instead (``stats.json`` holds the seconds it took: not compared). Returns 1 when one
    differs."""
    import tempfile

    from tppo_jax.config import load_config

    bad = 0
    for name in names:
        cfg = load_config(name)
        key = warmstart_key(cfg)
        with tempfile.TemporaryDirectory() as tmp:
            built = Path(tmp) / key
            if source is None:
                _train(cfg, built, progress=True)
            else:
                done = Path(source) / f"warmstart-{key}"
                if not (done / "DONE").is_file():
                    raise SystemExit(f"{done}: no finished warm-start of {name} (key {key})")
                _copy_files(done, built)
            _canonical_tokenizer(built, key)
            out = SHIPPED / f"warmstart-{key}"
            if not check:
                _copy_files(built, out)
                print(f"{name}: wrote {out}")
                continue
            differ = [f for f in CACHE_FILES if f != "stats.json" and not (
                (out / f).is_file() and (out / f).read_bytes() == (built / f).read_bytes())]
            bad += bool(differ)
            print(f"{name} ({key}): " + (f"DIFFERS in {', '.join(differ)}" if differ
                                         else "identical to the shipped files"))
    return int(bad > 0)


def _canonical_tokenizer(folder: Path, key: str) -> None:
    """Sets the path a sentencepiece model records as its training prefix (the cache folder
    it was trained in: its only machine-dependent bytes) to ``runs/warmstart-<key>/tokenizer``,
    what a checkout's first ``tppo train`` records, so shipped bytes name no build machine."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString((folder / "tokenizer.model").read_bytes())
    proto.trainer_spec.model_prefix = f"runs/warmstart-{key}/tokenizer"
    (folder / "tokenizer.model").write_bytes(proto.SerializeToString())


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="train the shipped configs' warm-starts into "
                                 "tppo_jax/warmstarts/ (or --check them against it)")
    ap.add_argument("configs", nargs="*", default=list(SHIPPED_CONFIGS))
    ap.add_argument("--check", action="store_true", help="compare, write nothing")
    ap.add_argument("--from", dest="source", type=Path, default=None, metavar="CACHE_ROOT",
                    help="take the finished warm-starts in CACHE_ROOT/warmstart-<key> (e.g. "
                    "runs/) instead of training them")
    a = ap.parse_args()
    raise SystemExit(ship(a.configs, a.check, a.source))
