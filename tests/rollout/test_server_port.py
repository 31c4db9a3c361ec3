"""The server owns its port, refuses over-long prompts (text or ids), and stops working for a
client that has gone.

One in-process server over the tiny Llama fixture serves every test here: a busy port is
refused (gRPC's SO_REUSEPORT let a second server share it), a text prompt longer than the
prefill is refused like the same prompt as token ids (it was cut to its last tokens), and
cancelled streams are neither prefilled nor decoded to ``max_tokens`` (no slot stays busy).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

# isort: split
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from tppo_jax.cli import _register_optional, build_parser
from tppo_jax.models.hf import from_pretrained
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine
from tppo_jax.rollout.jetstream_engine import JetStreamEngine
from tppo_jax.rollout.server import EngineServer, check_port, ensure_port_free, validate_request

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "llama"
REQ = jetstream_pb2.DecodeRequest
PREFILL = 16
SLOTS = 2


def _tokenizer(folder: Path) -> Tokenizer:
    """Words ``w3..w255`` over the fixture's 256-token vocabulary, one token per word."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 256)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer.load(folder)


class _Gate:
    """Wraps ``engine.prefill``: counts the calls, and holds one while ``hold`` is set."""

    def __init__(self, prefill):  # noqa: ANN001
        self._prefill, self.calls = prefill, 0
        self.hold, self.release, self.entered = threading.Event(), threading.Event(), \
            threading.Event()

    def __call__(self, **kwargs):  # noqa: ANN003, ANN204
        self.calls += 1
        if self.hold.is_set():
            self.hold.clear()
            self.entered.set()
            self.release.wait(120)
        return self._prefill(**kwargs)


class _Steps:
    """Wraps ``engine.generate``: counts decode steps."""

    def __init__(self, generate):  # noqa: ANN001
        self._generate, self.calls = generate, 0

    def __call__(self, *args):  # noqa: ANN002, ANN204
        self.calls += 1
        return self._generate(*args)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = _tokenizer(tmp_path_factory.mktemp("tok") / "words")
    core = DecodeEngine(from_pretrained(FIXTURE), eos_ids=(), kv_cache="paged",  # no early stop
                        max_slots=SLOTS, max_target_length=128, page_size=16,
                        sampling=SamplingParams(greedy=True))
    engine = JetStreamEngine(core, tok, max_prefill_length=PREFILL)
    gate, steps = _Gate(engine.prefill), _Steps(engine.generate)
    engine.prefill, engine.generate = gate, steps
    with EngineServer(engine) as server, grpc.insecure_channel(
            f"127.0.0.1:{server.port}") as channel:
        yield server, engine, gate, steps, jetstream_pb2_grpc.OrchestratorStub(channel)


def _decode(stub, request: REQ) -> list[int]:  # noqa: ANN001
    out: list[int] = []
    for resp in stub.Decode(request, timeout=180):
        for s in resp.stream_content.samples:
            out += list(s.token_ids)
    return out


def _wait(cond, what: str, timeout: float = 120.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ------------------------------------------------------------------------------- the port
def test_check_port_range() -> None:
    for ok in (0, 1, 9000, 65535):
        check_port(ok)
    for bad in (-1, 65536, 70000, True):
        with pytest.raises(ValueError, match="1..65535"):
            check_port(bad)
    with pytest.raises(ValueError, match="must be 1..65535"):
        check_port(0, allow_any=False)


def test_second_server_on_a_busy_port_is_refused(served) -> None:
    server, engine, _, _, stub = served
    with pytest.raises(OSError, match="already in use") as e:
        other = EngineServer(engine, port=server.port)
        other.stop()  # (the old code shared the port: two listeners, answers from two models)
    assert "\n" not in str(e.value)
    # The first server still owns the port and answers.
    assert _decode(stub, REQ(max_tokens=2, token_content=REQ.TokenContent(token_ids=[5, 6])))


def test_port_held_by_a_port_sharing_grpc_server_is_refused() -> None:
    async def hold_and_check() -> None:
        holder = grpc.aio.server()  # gRPC's default: SO_REUSEPORT on, as `tppo serve` had
        port = holder.add_insecure_port("127.0.0.1:0")
        await holder.start()
        try:
            with pytest.raises(OSError, match="already in use"):
                ensure_port_free("127.0.0.1", port)
        finally:
            await holder.stop(0)

    asyncio.run(hold_and_check())


def test_serve_on_a_busy_port_is_one_line(served) -> None:
    server = served[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    r = subprocess.run([sys.executable, "-m", "tppo_jax.cli", "serve", "--port",
                        str(server.port)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "already in use" in r.stderr
    assert "READY" not in r.stdout


@pytest.mark.parametrize("argv,msg", [
    (["serve", "--port", "70000"], "1..65535"),
    (["serve", "--port", "-1"], "1..65535"),
    (["serve", "--slots", "0"], "--slots: must be an integer in [1, "),
    (["serve", "--page-size", "0"], "--page-size: must be an integer in [1, "),
    (["serve", "--host", " "], "host must not be empty"),
    (["generate", "--token-ids", "1,a"], "token ids"),
    (["generate", "--port", "0"], "1..65535"),
    (["generate", "--max-tokens", "0"], "must be an integer in [1, "),
    (["generate", "--timeout", "nan"], "expected a finite number"),
])
def test_bad_arguments_are_one_line(argv, msg, capsys) -> None:
    _register_optional()  # what main() does first; parsing alone never starts a server
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_serve_missing_checkpoint_is_one_line(tmp_path, capsys) -> None:
    from tppo_jax.cli import main

    assert main(["serve", "--port", "0", "--checkpoint", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"tppo serve: --checkpoint {tmp_path / 'nope'}: not a directory "
                           "(nor a Hub id owner/name)")


def test_serve_hub_id_not_in_the_offline_cache_is_one_line(tmp_path, monkeypatch,
                                                           capsys) -> None:
    from tppo_jax.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--port", "0", "--checkpoint", "owner/missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tppo serve: --checkpoint owner/missing") and "\n" not in err
    assert "HF_HUB_OFFLINE" in err


# ------------------------------------------------------------------------ prompt lengths
def test_validate_request_measures_text_as_served() -> None:
    encode = lambda text: [5] * len(text.split())  # noqa: E731
    text = REQ(max_tokens=4, text_content=REQ.TextContent(text="w5 " * 17))
    assert validate_request(text, 256, 16, encode) == (
        "prompt has 17 tokens; this server takes at most 16")
    assert validate_request(REQ(max_tokens=4, text_content=REQ.TextContent(text="w5 " * 16)),
                            256, 16, encode) is None


def test_long_text_is_refused_like_long_token_ids(served) -> None:
    stub = served[4]
    codes = []
    for request in (REQ(max_tokens=2, text_content=REQ.TextContent(text="w7 " * (PREFILL + 1))),
                    REQ(max_tokens=2, token_content=REQ.TokenContent(
                        token_ids=[7] * (PREFILL + 1)))):
        with pytest.raises(grpc.RpcError) as e:
            _decode(stub, request)
        codes.append((e.value.code(), e.value.details()))
    want = f"prompt has {PREFILL + 1} tokens; this server takes at most {PREFILL}"
    assert codes == [(grpc.StatusCode.INVALID_ARGUMENT, want)] * 2
    # At the limit, text is served.
    assert _decode(stub, REQ(max_tokens=2, text_content=REQ.TextContent(text="w7 " * PREFILL)))


# ------------------------------------------------------------------- abandoned requests
def test_abandoned_requests_are_not_decoded(served) -> None:
    server, _, gate, steps, stub = served
    driver, n = server.driver, 8
    _wait(lambda: driver.busy_slots() == 0, "an idle server")
    prefills, decode_steps, dropped = gate.calls, steps.calls, driver.abandoned
    # Hold the first prefill so every request is queued, then abandon them all.
    gate.hold.set()
    long = REQ(max_tokens=100, token_content=REQ.TokenContent(token_ids=[9, 10, 11]))
    calls = [stub.Decode(long, timeout=180) for _ in range(n)]
    gate.entered.wait(60)
    _wait(lambda: driver.queued() == n - 1, f"{n - 1} queued requests")
    for c in calls:
        c.cancel()
    backlog = driver._prefill_backlog.queue  # the requests waiting behind the held prefill
    _wait(lambda: all(r.return_channel.cancelled() for r in list(backlog)), "the cancellations")
    gate.release.set()

    assert _decode(stub, REQ(max_tokens=4, token_content=REQ.TokenContent(token_ids=[5, 6])))
    _wait(lambda: driver.busy_slots() == 0 and driver.queued() == 0, "the slots freed")
    assert driver.abandoned - dropped == n
    assert gate.calls - prefills == 2  # the held request and the fresh one: none of the rest
    # The fresh request's 4 tokens and a step or two of the held one, not 100 per request.
    assert steps.calls - decode_steps < 50


def test_serve_takes_config_overrides(tmp_path, capsys) -> None:
    from tppo_jax.cli import main

    assert main(["serve", "--port", "0", "--http-port", "0", "rollout.temperature=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tppo serve: config error:") and "temperature" in err
    assert "\n" not in err


def test_serve_http_port_clash_is_one_line(capsys) -> None:
    from tppo_jax.cli import main

    assert main(["serve", "--port", "9123", "--http-port", "9123"]) == 2
    assert "pick two ports" in capsys.readouterr().err
