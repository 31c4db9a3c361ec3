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

from tppo_jax.cli.args import (
    add_config_args,
    int_at_least,
    non_negative_float,
    positive_float,
    top_p,
)
from tppo_jax.cli.log import log_to_stderr

log = logging.getLogger("tppo.serve")
DEFAULT_PORT = 9000  # JetStream gRPC
DEFAULT_HTTP_PORT = 8000  # OpenAI-compatible HTTP
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
    from tppo_jax.trainer.warmstart import tiny_model_config

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
    add_config_args(p)
    p.add_argument("--checkpoint", default=None,
                   help="HF-format policy directory (tokenizer beside it or in its parent)")
    p.add_argument("--start", action="store_true",
                   help="with a run directory: its starting policy instead of a checkpoint "
                   "(a run without a usable checkpoint is refused without it)")
    p.add_argument("--port", type=_port(allow_any=True), default=DEFAULT_PORT,
                   help="gRPC port: 1..65535, or 0 = any free port (printed on the READY line)")
    p.add_argument("--http-port", type=_port(allow_any=True), default=DEFAULT_HTTP_PORT,
                   help="OpenAI-compatible HTTP port (0 = any free port; printed on the "
                        "OPENAI line)")
    p.add_argument("--no-http", action="store_true", help="serve gRPC only")
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
    log_to_stderr(logging.DEBUG if args.verbose else logging.WARNING)
    cfg = load_config(args.config, args.overrides)
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
        try:
            http = None if args.no_http else _start_http(server, tok, core, cfg, host,
                                                         args.http_port, what)
        except OSError as e:
            server.stop()
            return _refuse(f"HTTP port: {e}")
        stop = threading.Event()
        # The servers stop whatever happens here: a stdout closed by the reader (`| head
        # -1`) must not leave them holding their ports after SIGTERM.
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            if http is not None:
                _say(f"OPENAI http://{http.host}:{http.port}/v1 (chat template: "
                     f"{'the tokenizer' + chr(39) + 's' if tok.chat_template else 'plain'})")
            _say(f"READY serving {what} on {server.host}:{server.port} "
                 f"({engine.max_concurrent_decodes} slots, {core.pages_total} KV pages)")
            stop.wait()
            _say("stopping")
        finally:
            if http is not None:
                http.stop()
            server.stop()
        _say("stopped")
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _start_http(server: Any, tok: Any, core: Any, cfg: Any, host: str, port: int,
                what: str) -> Any:
    """The OpenAI-compatible HTTP server over ``server``'s driver (``decode_ids``)."""
    from tppo_jax.rollout.tokenizer_adapter import encode_request_text
    from tppo_jax.serve.openai import OpenAIServer

    r = cfg.rollout
    return OpenAIServer(server.decode_ids, tok, lambda text: encode_request_text(tok, text),
                        sampling=core.sampling, model_name=Path(what).name or "tppo",
                        max_tokens=r.max_response_len, max_tokens_limit=r.max_response_len,
                        host=host, port=port).start()


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
    if args.no_http:
        return None
    if args.http_port == args.port and args.port != 0:
        return f"--http-port and --port are both {args.port}; pick two ports"
    try:
        ensure_port_free(host, args.http_port)
    except OSError as e:
        return f"{e} (this is the HTTP port: pass --http-port, or --no-http)"
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
    p.add_argument("prompt", nargs="?", default="", help="the user message (or raw text: --raw)")
    p.add_argument("--port", type=_port(allow_any=False), default=None,
                   help=f"default {DEFAULT_HTTP_PORT} (HTTP), {DEFAULT_PORT} with --grpc")
    p.add_argument("--host", type=_host, default="127.0.0.1")
    p.add_argument("--max-tokens", type=int_at_least(1), default=64)
    p.add_argument("--system", default=None, help="a system message before the prompt")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as raw text (no chat template)")
    p.add_argument("--grpc", action="store_true",
                   help="use the JetStream gRPC door (raw text; no sampling flags)")
    p.add_argument("--temperature", type=non_negative_float, default=None,
                   help="must equal the server's (it is fixed when the server starts)")
    p.add_argument("--top-p", type=top_p, default=None, help="as --temperature")
    p.add_argument("--token-ids", type=_token_ids, default=None,
                   help="comma-separated prompt token ids instead of text (gRPC; prints ids)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="seconds")


def cmd_generate(args: argparse.Namespace) -> int:
    if args.grpc or args.token_ids is not None:
        if args.temperature is not None or args.top_p is not None or args.system is not None:
            print("tppo generate: --temperature, --top-p and --system need the HTTP door "
                  "(leave out --grpc / --token-ids)", file=sys.stderr)
            return 2
        return _generate_grpc(args)
    from tppo_jax.serve.client import ServerError, stream

    if not args.prompt.strip():
        print("tppo generate: give a prompt", file=sys.stderr)
        return 2
    body: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if args.raw:
        path = "/v1/completions"
        body["prompt"] = args.prompt if args.system is None else \
            f"{args.system}\n\n{args.prompt}"
    else:
        path = "/v1/chat/completions"
        sys_msg = [] if args.system is None else [{"role": "system", "content": args.system}]
        body["messages"] = sys_msg + [{"role": "user", "content": args.prompt}]
    port = args.port or DEFAULT_HTTP_PORT
    try:
        for piece in stream(args.host, port, path, body, timeout=args.timeout):
            print(piece, end="", flush=True)
    except ServerError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"\nerror: cannot reach {args.host}:{port} ({e}); is `tppo serve` running "
              f"(its OPENAI line names the port)?", file=sys.stderr)
        return 1
    print(flush=True)
    return 0


def _generate_grpc(args: argparse.Namespace) -> int:
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
    with grpc.insecure_channel(f"{args.host}:{args.port or DEFAULT_PORT}") as channel:
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
    register_fn("serve", "serve the policy over OpenAI-compatible HTTP and JetStream gRPC "
                "(loopback by default)",
                _serve_args, cmd_serve)
    register_fn("generate", "stream a chat completion from a running `tppo serve`",
                _generate_args, cmd_generate)
