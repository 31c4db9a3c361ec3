"""The OpenAI-compatible HTTP door: a chat message through the tokenizer's chat template
decodes, greedily, the same tokens over HTTP (whole and streamed) as over JetStream gRPC and
as the engine itself; bad requests get a 4xx with a reason while the server keeps serving."""

import json
import socket
import struct
import time
from http.client import HTTPConnection

import grpc
import jax
import numpy as np
import pytest
from flax import nnx

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

# isort: split
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
from jetstream.engine import token_utils

from tppo_jax.data.prompts import chat_text
from tppo_jax.models.hf import from_pretrained
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine
from tppo_jax.rollout.jetstream_engine import JetStreamEngine
from tppo_jax.rollout.server import EngineServer
from tppo_jax.rollout.tokenizer_adapter import encode_request_text
from tppo_jax.serve.chat import MAX_TOP_LOGPROBS, Sampling
from tppo_jax.serve.client import ServerError, request, stream
from tppo_jax.serve.openai import OpenAIServer, TextStream

FIXTURE = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "hf" / "llama"
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}w10 {% else %}w11 {% endif %}"
            "{{ m['content'] }} w12 {% endfor %}{% if add_generation_prompt %}w13{% endif %}")
N = 8
MAX_CONN = 4  # handler threads of the fixture's HTTP server
IDLE = 1.5  # seconds its sockets wait on a client
ENCODED: list[int] = []  # the length of every text the server tokenized


def _tokenizer(tmp_path) -> Tokenizer:
    """A real ``tokenizer.json`` over the fixture's 256 ids (words ``w3..w255``) with a chat
    template in ``tokenizer_config.json``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 256)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "</s>", "chat_template": TEMPLATE}))
    return Tokenizer.load(tmp_path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = _tokenizer(tmp_path_factory.mktemp("tok"))
    model = from_pretrained(FIXTURE)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x,
                                   nnx.state(model, nnx.Param)))
    core = DecodeEngine(model, eos_ids=(2,), kv_cache="paged", max_slots=4,
                        max_target_length=64, page_size=16, sampling=SamplingParams(
                            temperature=0.0, per_row=True, top_logprobs=MAX_TOP_LOGPROBS))
    engine = JetStreamEngine(core, tok, max_prefill_length=32)

    def encode(text):
        ENCODED.append(len(text))
        return encode_request_text(tok, text)

    with EngineServer(engine) as grpc_server, OpenAIServer(
            grpc_server.decode_steps, tok, encode,
            sampling=Sampling(temperature=0.0, top_p=1.0), model_name="fixture", max_tokens=N,
            max_tokens_limit=16, max_prompt_tokens=32, max_connections=MAX_CONN,
            idle_timeout=IDLE) as http:
        yield tok, engine, grpc_server, http


MESSAGES = [{"role": "system", "content": "w40 w41"},
            {"role": "user", "content": "w17 w33 w5 w200"}]


def _engine_greedy(engine, ids, n):
    params = engine.load_params()
    padded, length = token_utils.pad_tokens(np.asarray(ids), 0, 0, is_bos=False,
                                            max_prefill_length=32)
    ds = engine.insert(engine.prefill(params=params, padded_tokens=padded,
                                      true_length=length), engine.init_decode_state(), 0)
    out = []
    for _ in range(n):
        ds, res = engine.generate(params, ds)
        out.append(int(np.asarray(res.data)[0, 0]))
    return out


def test_chat_greedy_http_equals_grpc_equals_engine(served):
    tok, engine, grpc_server, http = served
    text = chat_text(MESSAGES, tok)
    assert text == "w10 w40 w41 w12 w11 w17 w33 w5 w200 w12 w13"  # the template, applied
    ids = encode_request_text(tok, text)
    want = _engine_greedy(engine, ids, N)
    assert 2 not in want  # the fixture does not stop early here (all N tokens compared)

    req = jetstream_pb2.DecodeRequest
    with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        got_grpc = [t for r in stub.Decode(req(max_tokens=N, token_content=req.TokenContent(
            token_ids=ids)), timeout=120) for s in r.stream_content.samples for t in s.token_ids]
        grpc_text = "".join(s.text for r in stub.Decode(req(
            max_tokens=N, text_content=req.TextContent(text=text)), timeout=120)
                            for s in r.stream_content.samples)
    assert got_grpc == want
    assert list(grpc_server.decode_ids(ids, N)) == want

    body = {"model": "fixture", "messages": MESSAGES, "max_tokens": N, "temperature": 0}
    whole = request(http.host, http.port, "/v1/chat/completions", body)
    content = whole["choices"][0]["message"]["content"]
    assert content == tok.decode(want)
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": N,
                              "total_tokens": len(ids) + N}
    assert whole["choices"][0]["finish_reason"] == "length"
    streamed = "".join(stream(http.host, http.port, "/v1/chat/completions", body))
    assert streamed.split() == content.split()
    # gRPC text streams one decoded piece per token (this word-level decoder adds no spaces)
    assert grpc_text == "".join(tok.decode([t]) for t in want)

    raw = request(http.host, http.port, "/v1/completions",
                  {"prompt": text, "max_tokens": N})
    assert raw["choices"][0]["text"] == content  # the rendered text as a raw prompt: same
    ids_prompt = request(http.host, http.port, "/v1/completions",
                         {"prompt": ids, "max_tokens": 3})
    assert ids_prompt["choices"][0]["text"].split() == content.split()[:3]


@pytest.mark.parametrize("body,path,status,words", [
    ({"messages": MESSAGES, "temperature": -1}, "/v1/chat/completions", 400, "temperature"),
    ({"messages": []}, "/v1/chat/completions", 400, "messages"),
    ({"prompt": "w5", "max_tokens": 99}, "/v1/completions", 400, "limit"),
    ({"prompt": [5, 9999]}, "/v1/completions", 400, "vocabulary"),
    ({"prompt": "w5", "n": 99}, "/v1/completions", 400, "n must be"),
    ({"prompt": "w5", "stream": "false"}, "/v1/completions", 400, "stream must be true or false"),
    ({"prompt": "w5", "best_of": 2}, "/v1/completions", 400, "unknown parameter 'best_of'"),
    ({"prompt": "w5 " * 3000}, "/v1/completions", 400, "prompt limit of 32 tokens"),
    ({"prompt": list(range(3, 40))}, "/v1/completions", 400, "at most 32"),
    ({"prompt": "w5"}, "/v1/embeddings", 404, "no route"),
])
def test_bad_requests_are_refused_and_serving_goes_on(served, body, path, status, words):
    _, _, _, http = served
    with pytest.raises(ServerError) as e:
        request(http.host, http.port, path, body)
    assert f"HTTP {status}" in str(e.value) and words in str(e.value)
    ok = request(http.host, http.port, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 2})
    assert ok["choices"][0]["text"]
    assert request(http.host, http.port, "/v1/models")["data"][0]["id"] == "fixture"


def test_text_stream_holds_back_a_split_character():
    pieces = {(1,): "a\ufffd", (1, 2): "aé", (1, 2, 3): "aé b"}
    s = TextStream(lambda ids: pieces[tuple(ids)])
    assert [s.push(1), s.push(2), s.push(3), s.rest()] == ["", "aé", " b", ""]


# ----------------------------------------------------------------- bounded by the server
def _raw(http, data: bytes, timeout: float = 30.0) -> tuple[int, str]:
    """Sends ``data`` as is; the status and the whole answer (headers and body)."""
    with socket.create_connection((http.host, http.port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(1 << 16):
            got += chunk
    text = got.decode(errors="replace")
    return int(text.split()[1]), text


def _post(path: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{headers}\r\n").encode() + body


def _wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_big_bodies_and_prompts_are_refused_unread(served):
    _, _, _, http = served
    ENCODED.clear()
    # A body over the byte bound (from the 32-token prompt limit) is refused from its header.
    head = f"POST /v1/completions HTTP/1.1\r\nContent-Length: {8 << 20}\r\n\r\n".encode()
    status, text = _raw(http, head)
    assert status == 413 and "at most" in text
    # Within the byte bound, a text longer than the limit can hold is not tokenized.
    big = json.dumps({"prompt": "w5 " * 5000}).encode()
    status, text = _raw(http, _post("/v1/completions", big))
    assert status == 400 and "prompt limit of 32 tokens" in text
    status, _ = _raw(http, _post("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "w5 " * 5000}]}).encode()))
    assert status == 400
    assert all(n <= 32 * 64 for n in ENCODED), ENCODED


def test_connections_over_the_cap_get_503_and_idle_ones_time_out(served):
    _, _, _, http = served
    _wait_for(lambda: http.active_connections == 0)
    http.idle_timeout = 120  # these hold their handlers for the whole test, however slow
    idle = []
    try:
        idle += [socket.create_connection((http.host, http.port)) for _ in range(MAX_CONN)]
        _wait_for(lambda: http.active_connections == MAX_CONN)
        status, text = _raw(http, _post("/v1/completions", b'{"prompt": "w5"}'))
        assert status == 503 and "Retry-After: 1" in text
    finally:
        http.idle_timeout = IDLE
        for s in idle:
            s.close()
    _wait_for(lambda: http.active_connections == 0)
    with socket.create_connection((http.host, http.port)) as silent:
        silent.settimeout(IDLE + 30)
        assert silent.recv(100) == b""  # the server closed the silent socket
    assert request(http.host, http.port, "/v1/completions",
                   {"prompt": "w5", "max_tokens": 1})["choices"]


@pytest.mark.parametrize("data,status,words", [
    (_post("/v1/completions", b"").replace(b"Content-Length: 0", b"Content-Length: -1"),
     400, "Content-Length"),
    (_post("/v1/completions", b"[" * 20_000 + b"]" * 20_000), 400, "nested too deeply"),
    (_post("/v1/completions", b'{"prompt": "w5 \\ud800"}'), 400, "Unicode"),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411,
     "Content-Length"),
])
def test_malformed_bodies_get_400_at_once(served, data, status, words):
    _, _, _, http = served
    got, text = _raw(http, data, timeout=IDLE + 20)  # (a socket left to time out: no status)
    assert (got, words in text, "server_error" in text) == (status, True, False), text[-300:]


def test_a_client_that_leaves_is_one_log_line(served, capfd, caplog):
    _, _, _, http = served
    _wait_for(lambda: http.active_connections == 0)
    capfd.readouterr()
    for _ in range(3):
        sock = socket.create_connection((http.host, http.port))
        sock.sendall(_post("/v1/completions", b'{"prompt": "w5 w6 w7 w8 w9"}')[:-10])
        # close with a reset: the server's read (or its answer) then fails
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    _wait_for(lambda: http.active_connections == 0)
    assert "Traceback" not in capfd.readouterr().err


# ----------------------------------------------------------------- what clients send
def _complete(http, **body):
    return request(http.host, http.port, "/v1/completions",
                   {"prompt": "w17 w33 w5 w200", "max_tokens": N} | body)


def test_sampling_is_per_request_and_seeded(served):
    _, _, grpc_server, http = served
    ids = [17, 33, 5, 200]  # the word-level ids of the prompt
    greedy = list(grpc_server.decode_ids(ids, N))  # the server's default: temperature 0
    got = _complete(http, temperature=0, return_token_ids=True)
    assert got["choices"][0]["token_ids"] == greedy and got["prompt_token_ids"] == ids
    hot = dict(temperature=3.0, seed=7, n=3, return_token_ids=True)
    a, b = _complete(http, **hot), _complete(http, **hot)
    runs = [[c["token_ids"] for c in r["choices"]] for r in (a, b)]
    assert runs[0] == runs[1]  # a seed draws the same tokens on every call
    assert len({tuple(t) for t in runs[0]}) == 3  # and each choice its own stream
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert greedy not in runs[0]
    other = _complete(http, **hot | {"seed": 8})
    assert [c["token_ids"] for c in other["choices"]] != runs[0]


def test_logprobs_are_of_the_distribution_sampled(served):
    _, _, _, http = served
    body = {"model": "fixture", "messages": MESSAGES, "max_tokens": 3, "logprobs": True,
            "top_logprobs": 5}
    cold = request(http.host, http.port, "/v1/chat/completions", body | {"temperature": 0})
    for e in cold["choices"][0]["logprobs"]["content"]:  # greedy: the top token, temperature 1
        assert e["token"] == e["top_logprobs"][0]["token"]
        assert e["logprob"] == e["top_logprobs"][0]["logprob"] <= 0
    # Temperature T scales the log-prob gaps by 1/T (same seed: same first token).
    first = {}
    for t in (1.0, 0.5):
        r = request(http.host, http.port, "/v1/chat/completions",
                    body | {"temperature": t, "seed": 1, "max_tokens": 1})
        first[t] = {x["token"]: x["logprob"] for x in
                    r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}
    a, b = list(first[1.0])[:2]
    gap = first[1.0][a] - first[1.0][b]
    assert first[0.5][a] - first[0.5][b] == pytest.approx(2 * gap, rel=1e-4, abs=1e-4)
    # top_p: alternatives outside the nucleus are left out; the rest renormalized.
    nucleus = request(http.host, http.port, "/v1/chat/completions", body | {
        "temperature": 1.0, "top_p": 0.1, "seed": 1, "max_tokens": 1, "top_logprobs": 20})
    tops = nucleus["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(tops) < 20 and sum(np.exp(x["logprob"]) for x in tops) == pytest.approx(1, 1e-4)
    raw = _complete(http, logprobs=2, max_tokens=2)["choices"][0]["logprobs"]
    assert len(raw["tokens"]) == len(raw["token_logprobs"]) == 2
    assert raw["text_offset"][0] == 0 and all(len(d) == 2 for d in raw["top_logprobs"])


def test_stop_strings_and_streamed_choices(served):
    tok, _, grpc_server, http = served
    greedy = list(grpc_server.decode_ids([17, 33, 5, 200], N))
    words = [tok.decode([t]) for t in greedy]
    whole = _complete(http, stop=[words[2]])["choices"][0]
    full = tok.decode(greedy)
    assert whole["finish_reason"] == "stop" and whole["text"] == full[:full.find(words[2])]
    assert whole["text"].split() == words[:2]
    conn_body = {"prompt": "w17 w33 w5 w200", "max_tokens": N, "n": 2, "stream": True,
                 "temperature": 2.0, "seed": 3, "return_token_ids": True,
                 "stream_options": {"include_usage": True}}
    conn = HTTPConnection(http.host, http.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(conn_body))
    events = [json.loads(line[5:]) for line in conn.getresponse().read().decode().splitlines()
              if line.startswith("data: {")]
    conn.close()
    per = {0: [], 1: []}
    for e in events[:-1]:
        for c in e["choices"]:
            per[c["index"]] += c["token_ids"]
    want = _complete(http, **{k: v for k, v in conn_body.items()
                              if k not in ("stream", "stream_options")})
    assert [per[0], per[1]] == [c["token_ids"] for c in want["choices"]]
    assert events[-1]["usage"]["completion_tokens"] == len(per[0]) + len(per[1])
    assert request(http.host, http.port, "/v1/models")["data"][0]["id"] == "fixture"


def test_grpc_text_over_the_character_bound_is_refused_untokenized():
    from tppo_jax.rollout.server import validate_request

    def encode(text):
        raise AssertionError("tokenized")

    req = jetstream_pb2.DecodeRequest(max_tokens=4, text_content=(
        jetstream_pb2.DecodeRequest.TextContent(text="w5 " * 1000)))
    assert "at most 32 tokens" in validate_request(req, 256, 32, encode)


def test_text_stream_holds_back_a_possible_stop_string():
    pieces = {(1,): "a b", (1, 2): "a bE", (1, 2, 3): "a bEN", (1, 2, 3, 4): "a bENDx"}
    s = TextStream(lambda ids: pieces[tuple(ids)], stop=("END",))
    assert [s.push(1), s.push(2), s.push(3), s.push(4)] == ["a b", "", "", ""]
    assert s.stopped and s.text == "a b" and s.rest() == ""
    s = TextStream(lambda ids: {(1,): "xE", (1, 2): "xEy"}[tuple(ids)], stop=("END",))
    assert [s.push(1), s.push(2), s.rest()] == ["x", "Ey", ""] and not s.stopped


def test_the_openai_client_sends_what_the_server_takes(served):
    """The official ``openai`` client against the server: chat with per-request sampling,
    a seed, ``n``, log-probs and a stop string; completions from token ids; an unknown
    parameter is a 400 the client raises as ``BadRequestError``."""
    openai = pytest.importorskip("openai")
    _, _, _, http = served
    client = openai.OpenAI(base_url=f"http://{http.host}:{http.port}/v1", api_key="none",
                           max_retries=0, timeout=120)
    assert client.models.list().data[0].id == "fixture"
    kw = dict(model="fixture", messages=MESSAGES, max_tokens=3, temperature=2.0, seed=5, n=2,
              logprobs=True, top_logprobs=2)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2 and all(len(c.logprobs.content) >= 1 for c in a.choices)
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2
               for c in a.choices for e in c.logprobs.content)
    greedy = client.completions.create(model="fixture", prompt=[17, 33, 5, 200], max_tokens=N,
                                       temperature=0)
    text = greedy.choices[0].text
    words = text.split()
    assert len(words) >= 3
    cut = client.completions.create(model="fixture", prompt=[17, 33, 5, 200], max_tokens=N,
                                    temperature=0, stop=[words[2]])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text.split() == words[:2]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fixture", messages=MESSAGES, max_tokens=1,
                                       extra_body={"no_such_parameter": 1})
