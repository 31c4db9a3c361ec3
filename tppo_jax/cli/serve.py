"""``tppo serve`` / ``tppo generate``: the decode engine that trains, behind JetStream's gRPC
API (``rollout.jetstream_engine`` adapts it; JetStream is imported only inside these commands).

``tppo serve RUN`` serves a run directory's newest good policy checkpoint as the run was
configured: its ``config.yaml`` sets the prompt and response lengths, the dtype, the sampling
and the prompt format of chat requests (``--config`` replaces it; ``key=value`` overrides
either). RUN may also be an HF folder or a Hub id (then the config is ``--config`` or the
embedded default). With no RUN it serves, in order of preference: the default run's latest
policy checkpoint (``runs/default``, with its config), the latest warm-started policy
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
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tppo_jax.cli.args import (
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


def served_run(checkpoint: str | None) -> Path | None:
    """The run directory ``tppo serve`` serves: the one named, or with nothing named the
    default run (``runs/default``) once it has a checkpoint; None for an HF folder."""
    from tppo_jax.weights.restore import is_run_dir

    if checkpoint is not None:
        return Path(checkpoint) if is_run_dir(Path(checkpoint)) else None
    default_run = Path("runs/default")
    if is_run_dir(default_run) and any(
            p.name.isdigit() for p in (default_run / "checkpoints").glob("*")):
        return default_run
    return None


def serving_config(args: argparse.Namespace) -> Any:
    """The config a server runs with: ``--config`` if given, else the served run's
    ``config.yaml`` (as ``tppo eval RUN`` reads it), else the embedded default; the
    ``key=value`` overrides on top."""
    from tppo_jax.config import load_config

    run = served_run(args.checkpoint)
    if args.config is None and run is not None:
        return load_config(run / "config.yaml", args.overrides)
    return load_config(args.config, args.overrides)


def load_serving_model(checkpoint: str | None, cfg: Any, scratch: Path, *, start: bool = False
                       ) -> tuple[Any, Any, str, str, str]:
    """Returns ``(model, tokenizer, tokenizer_path, description, model name)``; ``start``:
    a run directory's starting policy instead of its checkpoint."""
    from tppo_jax.weights.named import load_hf_folder

    ckpt = Path(checkpoint) if checkpoint else None
    # A run directory (ours: config.yaml + Orbax checkpoints), given or the default run's.
    run_dir = served_run(checkpoint)
    if run_dir is not None:
        from tppo_jax.weights.restore import policy_from_run

        got = policy_from_run(run_dir, start=start)
        return (got.model, got.tokenizer, str(got.tokenizer_file), got.description,
                run_dir.resolve().name)
    if ckpt is None and cfg.model.source == "hf" and cfg.model.path:
        from tppo_jax.models.hub import resolve_model

        ckpt = Path(resolve_model(cfg.model.path))
    if ckpt is None and (ws := latest_warmstart()) is not None:
        ckpt = ws / "policy"
    if ckpt is not None:
        model, tok, tok_file = load_hf_folder(ckpt, cfg.model.dtype)
        return model, tok, str(tok_file), str(ckpt), ckpt.resolve().name

    from tppo_jax.data.synthetic import SyntheticMathTask
    from tppo_jax.models.tokenizer import train_sentencepiece
    from tppo_jax.models.transformer import create_model
    from tppo_jax.weights.warmstart import tiny_model_config

    banner = "!" * 78
    msg = ("no checkpoint and no runs/warmstart-*/policy found: serving a FRESHLY INITIALISED "
           "tiny model (random weights, gibberish output). Run `tppo train` or pass "
           "--checkpoint DIR for a real policy.")
    print(f"{banner}\nWARNING: {msg}\n{banner}", file=sys.stderr, flush=True)
    texts = SyntheticMathTask(seed=0).teacher_corpus(300, 0.0, 0.0)
    tok = train_sentencepiece(texts, scratch / "tokenizer", vocab_size=128)
    model = create_model(tiny_model_config(cfg, tok.vocab_size), seed=0)
    return (model, tok, str(scratch / "tokenizer.model"), "fresh tiny model (random weights)",
            "tiny-random")


# ---------------------------------------------------------------------------------- serve
def _serve_args(p: argparse.ArgumentParser) -> None:
    p.description = ("tppo serve [RUN] [key=value ...]: serve RUN (a run directory, served "
                     "as its config.yaml configures it; an HF folder; or a Hub id "
                     "owner/name[@revision]) over OpenAI-compatible HTTP and JetStream gRPC.")
    p.add_argument("overrides", nargs="*", metavar="[RUN] key=value",
                   help="RUN (as --checkpoint), then config overrides, e.g. "
                        "rollout.temperature=0")
    p.add_argument("--config", default=None,
                   help="YAML file or shipped config name, instead of the served run's "
                        "config.yaml (default: the run's, else the embedded default)")
    p.add_argument("--checkpoint", default=None,
                   help="what to serve, as the positional RUN: a run directory (its newest "
                        "good checkpoint, with its config), an HF folder (tokenizer beside it "
                        "or in its parent) or a Hub id")
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
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.rollout.engine import DecodeEngine
    from tppo_jax.rollout.jetstream_engine import JetStreamEngine
    from tppo_jax.rollout.server import EngineServer
    from tppo_jax.serve.chat import MAX_TOP_LOGPROBS, chat_format

    host = args.host or LOOPBACK_HOST
    if (err := _take_run_arg(args)) is not None:
        return _refuse(err)
    if (err := _serve_arg_error(args, host)) is not None:
        return _refuse(err)
    # JetStream logs every decode step at INFO on the root logger; keep that for --verbose.
    log_to_stderr(logging.DEBUG if args.verbose else logging.WARNING)
    cfg = serving_config(args)
    r = cfg.rollout
    scratch = Path(tempfile.mkdtemp(prefix="tppo-serve-"))
    try:
        try:
            model, tok, tok_path, what, name = load_serving_model(
                args.checkpoint, cfg, scratch, start=args.start)
        except (OSError, ValueError) as e:  # no tokenizer / config.json, unreadable files
            return _refuse(f"cannot load the model to serve: {e}")
        prefill = _prefill_bucket(r.max_prompt_len)
        core = DecodeEngine(
            model, eos_ids=tok.eos_ids, max_slots=args.slots,
            page_size=args.page_size or r.page_size,
            max_target_length=max(prefill, r.max_prompt_len) + r.max_response_len,
            num_pages=r.num_pages, kv_cache=r.kv_cache,
            # Each request's temperature / top_p are traced values: one program for all.
            sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    per_row=True, top_logprobs=MAX_TOP_LOGPROBS))
        engine = JetStreamEngine(core, tok, max_prefill_length=prefill, tokenizer_path=tok_path,
                                 strict_insert=False)
        try:
            server = EngineServer(engine, host=host, port=args.port).start()
        except OSError as e:  # the port was taken while the model loaded
            return _refuse(str(e))
        try:
            http = None if args.no_http else _start_http(server, tok, cfg, host,
                                                         args.http_port, name)
        except OSError as e:
            server.stop()
            return _refuse(f"HTTP port: {e}")
        # The servers stop whatever happens here: a stdout closed by the reader (`| head
        # -1`) must not leave them holding their ports after SIGTERM.
        try:
            with StopSignals() as stop:
                if http is not None:
                    _say(f"OPENAI http://{http.host}:{http.port}/v1 (chat requests as "
                         f"{chat_format(cfg, tok)})")
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


class StopSignals:
    """SIGINT / SIGTERM, waited for without a lock in the handler: the signal's byte reaches
    a socket through ``signal.set_wakeup_fd`` and ``wait`` reads it. (A handler that sets a
    ``threading.Event`` deadlocks when the signal lands while the main thread holds that
    Event's lock inside ``wait()``, as a SIGTERM sent right after READY can.)"""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> StopSignals:
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, lambda *_: None) for s in self.SIGNALS}
        return self

    def wait(self) -> int:
        """Blocks until SIGINT or SIGTERM arrives (after ``__enter__``); returns it."""
        while True:
            data = self._read.recv(64)
            for signum in data:
                if signum in self.SIGNALS:
                    return signum

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._old_fd)
        self._read.close()
        self._write.close()


def _start_http(server: Any, tok: Any, cfg: Any, host: str, port: int, name: str) -> Any:
    """The OpenAI-compatible HTTP server over ``server``'s driver (``decode_steps``), chat
    requests rendered in the run's prompt format (``serve.chat.chat_renderer``)."""
    from tppo_jax.rollout.tokenizer_adapter import encode_request_text
    from tppo_jax.serve.chat import Sampling, chat_renderer
    from tppo_jax.serve.openai import OpenAIServer

    r = cfg.rollout
    return OpenAIServer(server.decode_steps, tok, lambda text: encode_request_text(tok, text),
                        sampling=Sampling(temperature=r.temperature, top_p=r.top_p),
                        model_name=name, max_tokens=r.max_response_len,
                        max_tokens_limit=r.max_response_len,
                        max_prompt_tokens=server.engine.max_prefill_length,
                        chat=chat_renderer(cfg, tok), host=host, port=port).start()


def _take_run_arg(args: argparse.Namespace) -> str | None:
    """Moves the positional RUN (the one argument without ``=``) to ``args.checkpoint``;
    what is wrong with it otherwise."""
    refs = [o for o in args.overrides if "=" not in o]
    args.overrides = [o for o in args.overrides if "=" in o]
    if len(refs) > 1:
        return f"one RUN to serve, got {len(refs)}: {' '.join(refs[:3])}"
    if refs and args.checkpoint is not None:
        return f"RUN {refs[0]} and --checkpoint {args.checkpoint}: give one"
    if refs:
        args.checkpoint = refs[0]
    return None


def _serve_arg_error(args: argparse.Namespace, host: str) -> str | None:
    """What is wrong with ``serve``'s arguments beyond their types, checked before a model is
    loaded or compiled: a missing ``--checkpoint`` folder (a Hub id is resolved here), a busy
    port."""
    from tppo_jax.rollout.server import ensure_port_free

    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        from tppo_jax.weights.named import resolve_policy_path

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
                   help="this request's (0 = greedy; default: the server's)")
    p.add_argument("--top-p", type=top_p, default=None,
                   help="this request's nucleus (default: the server's)")
    p.add_argument("--seed", type=int_at_least(0), default=None,
                   help="sample reproducibly (the same seed, the same text)")
    p.add_argument("--token-ids", type=_token_ids, default=None,
                   help="comma-separated prompt token ids instead of text (gRPC; prints ids)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="seconds")


def cmd_generate(args: argparse.Namespace) -> int:
    if args.grpc or args.token_ids is not None:
        if any(x is not None for x in (args.temperature, args.top_p, args.seed, args.system)):
            print("tppo generate: --temperature, --top-p, --seed and --system need the HTTP door "
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
    if args.seed is not None:
        body["seed"] = args.seed
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
