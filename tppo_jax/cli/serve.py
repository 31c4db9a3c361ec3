"""``tppo serve`` / ``tppo generate``: the decode engine that trains, behind JetStream's gRPC
API (``rollout.jetstream_engine`` adapts it; JetStream is imported only inside these commands).

``tppo serve`` with no arguments serves, in order of preference: the default run's latest
policy checkpoint (``runs/default``), the latest warm-started policy
(``runs/warmstart-*/policy`` + ``tokenizer.model``), or a freshly initialised tiny model
(random weights: gibberish output) with a tokenizer trained on a few
synthetic lines. ``tppo generate --port P "text"`` streams one completion from a server.

Registered in the ``tppo`` command table by ``register(register_fn)``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tppo_jax.cli.args import int_at_least, positive_float

log = logging.getLogger("tppo.serve")
DEFAULT_PORT = 9000
DEFAULT_SLOTS = 8


# --------------------------------------------------------------------- argument types
# argparse turns the ArgumentTypeError of a type= function into one usage line, exit 2.
def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None


def _port(allow_any: bool) -> Callable[[str], int]:
    """A port number as ``rollout.server.check_port`` allows it (``allow_any``: 0 too)."""
    def parse(text: str) -> int:
        from tppo_jax.rollout.server import check_port

        value = _integer(text)
        try:
            check_port(value, allow_any=allow_any)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    return parse


MAX_TOKEN_ID = 2**31 - 1  # DecodeRequest.token_ids are int32


def _token_ids(text: str) -> list[int]:
    """``5,6,7`` -> ``[5, 6, 7]`` (the server checks them against its vocabulary)."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isascii() and x.isdigit() and int(x) <= MAX_TOKEN_ID
                            for x in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids in 0..{MAX_TOKEN_ID}, got {text[:40]!r}")
    return [int(x) for x in parts]


def _host(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("host must not be empty")
    return text.strip()


def _prefill_bucket(n: int) -> int:
    from tppo_jax.rollout.jetstream_engine import PREFILL_BUCKETS

    return next((b for b in PREFILL_BUCKETS if b >= n), PREFILL_BUCKETS[-1])


def latest_warmstart(root: Path = Path("runs")) -> Path | None:
    """The newest ``runs/warmstart-*`` with a finished export (policy/ + tokenizer.model)."""
    need = ("DONE", "policy/config.json", "tokenizer.model")
    done = [d for d in root.glob("warmstart-*") if all((d / n).exists() for n in need)]
    return max(done, key=lambda d: (d / "DONE").stat().st_mtime, default=None)


def load_serving_model(checkpoint: str | None, cfg: Any, scratch: Path, *, start: bool = False
                       ) -> tuple[Any, Any, str, str]:
    """Returns ``(model, tokenizer, tokenizer_path, description)``; ``start``: a run
    directory's starting policy instead of its checkpoint."""
    from tppo_jax.cli.policy import is_run_dir, load_hf_folder, load_policy

    ckpt = Path(checkpoint) if checkpoint else None
    # A run directory (ours: config.yaml + Orbax checkpoints), given or the default run's.
    default_run = Path("runs/default")
    run_dir = ckpt if ckpt is not None and is_run_dir(ckpt) else None
    if ckpt is None and is_run_dir(default_run) and any(
            p.name.isdigit() for p in (default_run / "checkpoints").glob("*")):
        run_dir = default_run
    if run_dir is not None:
        from functools import partial

        from tppo_jax.cli.runs import load_run_policy

        got = load_policy(str(run_dir), dtype=cfg.model.dtype,
                          load_run=partial(load_run_policy, start=start))
        return got.model, got.tokenizer, str(got.tokenizer_file), got.description
    if ckpt is None and cfg.model.source == "hf" and cfg.model.path:
        from tppo_jax.models.hub import resolve_model

        ckpt = Path(resolve_model(cfg.model.path))
    if ckpt is None and (ws := latest_warmstart()) is not None:
        ckpt = ws / "policy"
    if ckpt is not None:
        model, tok, tok_file = load_hf_folder(ckpt, cfg.model.dtype)
        return model, tok, str(tok_file), str(ckpt)

    from tppo_jax.data.synthetic import SyntheticMathTask
    from tppo_jax.models.tokenizer import train_sentencepiece
    from tppo_jax.models.transformer import create_model
    from tppo_jax.train.warmstart import tiny_model_config

    banner = "!" * 78
    msg = ("no checkpoint and no runs/warmstart-*/policy found: serving a FRESHLY INITIALISED "
           "tiny model (random weights, gibberish output). Run `tppo train` or pass "
           "--checkpoint DIR for a real policy.")
    print(f"{banner}\nWARNING: {msg}\n{banner}", file=sys.stderr, flush=True)
    texts = SyntheticMathTask(seed=0).teacher_corpus(300, 0.0, 0.0)
    tok = train_sentencepiece(texts, scratch / "tokenizer", vocab_size=128)
    model = create_model(tiny_model_config(cfg, tok.vocab_size), seed=0)
    return model, tok, str(scratch / "tokenizer.model"), "fresh tiny model (random weights)"


# ---------------------------------------------------------------------------------- serve
def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file or shipped config name")
    p.add_argument("--checkpoint", default=None,
                   help="HF-format policy directory (tokenizer beside it or in its parent)")
    p.add_argument("--start", action="store_true",
                   help="with a run directory: its starting policy instead of a checkpoint "
                   "(a run without a usable checkpoint is refused without it)")
    p.add_argument("--port", type=_port(allow_any=True), default=DEFAULT_PORT,
                   help="1..65535, or 0 = any free port (printed on the READY line)")
    p.add_argument("--host", type=_host, default=None,
                   help="bind address (default 127.0.0.1 only)")
    p.add_argument("--slots", type=int_at_least(1), default=DEFAULT_SLOTS,
                   help="concurrent decodes")
    p.add_argument("--page-size", type=int_at_least(1), default=None)
    p.add_argument("--verbose", action="store_true", help="log every JetStream step")


def cmd_serve(args: argparse.Namespace) -> int:
    from tppo_jax.compat.jetstream import LOOPBACK_HOST
    from tppo_jax.config import load_config
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.rollout.engine import DecodeEngine
    from tppo_jax.rollout.jetstream_engine import JetStreamEngine
    from tppo_jax.rollout.server import EngineServer

    host = args.host or LOOPBACK_HOST
    if (err := _serve_arg_error(args, host)) is not None:
        return _refuse(err)
    # JetStream logs every decode step at INFO on the root logger; keep that for --verbose.
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", force=True)
    cfg = load_config(args.config, [])
    r = cfg.rollout
    scratch = Path(tempfile.mkdtemp(prefix="tppo-serve-"))
    try:
        try:
            model, tok, tok_path, what = load_serving_model(args.checkpoint, cfg, scratch,
                                                       start=args.start)
        except (OSError, ValueError) as e:  # no tokenizer / config.json, unreadable files
            return _refuse(f"cannot load the model to serve: {e}")
        prefill = _prefill_bucket(r.max_prompt_len)
        core = DecodeEngine(
            model, eos_ids=tok.eos_ids, max_slots=args.slots,
            page_size=args.page_size or r.page_size,
            max_target_length=max(prefill, r.max_prompt_len) + r.max_response_len,
            num_pages=r.num_pages, kv_cache=r.kv_cache,
            sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k))
        engine = JetStreamEngine(core, tok, max_prefill_length=prefill, tokenizer_path=tok_path,
                                 strict_insert=False)
        try:
            server = EngineServer(engine, host=host, port=args.port).start()
        except OSError as e:  # the port was taken while the model loaded
            return _refuse(str(e))
        stop = threading.Event()
        # The server stops whatever happens here: a stdout closed by the reader (`| head
        # -1`) must not leave it holding the port after SIGTERM.
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            _say(f"READY serving {what} on {server.host}:{server.port} "
                 f"({engine.max_concurrent_decodes} slots, {core.pages_total} KV pages)")
            stop.wait()
            _say("stopping")
        finally:
            server.stop()
        _say("stopped")
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _serve_arg_error(args: argparse.Namespace, host: str) -> str | None:
    """What is wrong with ``serve``'s arguments beyond their types, checked before a model is
    loaded or compiled: a missing ``--checkpoint`` folder (a Hub id is resolved here), a busy
    port."""
    from tppo_jax.rollout.server import ensure_port_free

    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        from tppo_jax.cli.policy import resolve_policy_path

        try:  # a Hub id: fetched (or found in the HF cache) before anything compiles
            args.checkpoint = str(resolve_policy_path(args.checkpoint, "--checkpoint"))
        except ValueError as e:
            return str(e)
    try:
        ensure_port_free(host, args.port)
    except OSError as e:
        return str(e)
    return None


def _say(line: str) -> None:
    """Prints a status line; a closed stdout (its reader gone) sends the rest to /dev/null
    instead of raising, so serving and stopping go on."""
    try:
        print(line, flush=True)
    except (BrokenPipeError, ValueError, OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, sys.stdout.fileno())  # the exit's flush then finds no pipe
        os.close(devnull)


def _refuse(msg: str) -> int:
    print(f"tppo serve: {msg}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------- generate
def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default="", help="prompt text")
    p.add_argument("--port", type=_port(allow_any=False), default=DEFAULT_PORT)
    p.add_argument("--host", type=_host, default="127.0.0.1")
    p.add_argument("--max-tokens", type=int_at_least(1), default=64)
    p.add_argument("--token-ids", type=_token_ids, default=None,
                   help="comma-separated prompt token ids instead of text")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="seconds")


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

    # isort: split
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

    req = jetstream_pb2.DecodeRequest(max_tokens=args.max_tokens)
    if args.token_ids is not None:
        req.token_content.CopyFrom(jetstream_pb2.DecodeRequest.TokenContent(
            token_ids=args.token_ids))
    else:
        req.text_content.CopyFrom(jetstream_pb2.DecodeRequest.TextContent(text=args.prompt))
    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        try:
            for resp in stub.Decode(req, timeout=args.timeout):
                for s in resp.stream_content.samples:
                    out = s.text if args.token_ids is None else " ".join(map(str, s.token_ids))
                    print(out, end="" if args.token_ids is None else " ", flush=True)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(flush=True)
    return 0


# ---------------------------------------------------------------------------------- bench
def register(register_fn: Callable[..., None]) -> None:
    """Adds ``serve`` and ``generate`` via ``register_fn(name, help, add, run)``."""
    register_fn("serve", "serve the policy over JetStream gRPC (loopback by default)",
                _serve_args, cmd_serve)
    register_fn("generate", "stream a completion from a running `tppo serve`",
                _generate_args, cmd_generate)
