"""The served prompt is the prompt the user sent: JetStream's orchestrator would prepend
``bos_id`` (or, for a tokenizer without BOS, the pad id) to every request; ``tppo serve``
adds a BOS only where the model's own tokenizer does, never doubled, so text and token-id
requests decode the same tokens as the engine does on those ids."""

import json
import types

import jax
import numpy as np
import pytest
from flax import nnx

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

# isort: split
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
from jetstream.engine import token_utils

from tppo_jax.models.hf import from_pretrained
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine
from tppo_jax.rollout.jetstream_engine import JetStreamEngine
from tppo_jax.rollout.server import EngineServer, PromptAsSentDriver
from tppo_jax.rollout.tokenizer_adapter import JetStreamTokenizer, encode_request_text

FIXTURE = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "hf" / "llama"


def _tokenizer(tmp_path, *, adds_bos: bool) -> Tokenizer:
    """A real ``tokenizer.json`` over the fixture's 256-token vocabulary: words ``w3..w255``,
    ``<s>``/``</s>`` specials, and (Llama-like) a post-processor that prepends ``<s>``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 256)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 1)])
    d = tmp_path / ("llama_like" if adds_bos else "no_bos")
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>" if adds_bos else None, "eos_token": "</s>"}))
    return Tokenizer.load(d)


def test_text_gets_bos_only_where_the_tokenizer_adds_one(tmp_path):
    llama = _tokenizer(tmp_path, adds_bos=True)
    plain = _tokenizer(tmp_path, adds_bos=False)
    assert encode_request_text(llama, "w5 w9") == [1, 5, 9]
    assert encode_request_text(llama, "<s> w5 w9") == [1, 5, 9]  # never doubled
    assert encode_request_text(plain, "w5 w9") == [5, 9]  # no pad in front either
    padded, n = JetStreamTokenizer(plain).encode("w5 w9", is_bos=True, max_prefill_length=16)
    assert n == 2 and np.asarray(padded)[:2].tolist() == [5, 9]


def test_token_requests_are_not_given_a_bos():
    driver = PromptAsSentDriver.__new__(PromptAsSentDriver)  # no threads: one method under test
    driver._jax_padding = False
    tok = types.SimpleNamespace(bos_id=1, pad_id=0)
    request = types.SimpleNamespace(prefill_content=[1, 7, 8])  # as the orchestrator has it
    padded, n = driver._process_prefill_content(request, tok, True, 16)
    assert n == 3 and padded[:3].tolist() == [1, 7, 8]


@pytest.mark.parametrize("adds_bos", [True, False])
def test_served_text_and_ids_equal_the_engine(tmp_path, adds_bos):
    tok = _tokenizer(tmp_path, adds_bos=adds_bos)
    model = from_pretrained(FIXTURE)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x,
                                   nnx.state(model, nnx.Param)))
    engine = JetStreamEngine(DecodeEngine(model, eos_ids=(2,), kv_cache="paged", max_slots=2,
                                          max_target_length=64, page_size=16,
                                          sampling=SamplingParams(greedy=True)),
                             tok, max_prefill_length=32)
    text = "w17 w33 w5 w200 w91 w64 w3"
    ids = encode_request_text(tok, text)
    # Reference: the engine's JetStream path on exactly these ids.
    params = engine.load_params()
    padded, n = token_utils.pad_tokens(np.asarray(ids), 0, 0, is_bos=False,
                                       max_prefill_length=32)
    ds = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n),
                       engine.init_decode_state(), 0)
    want = []
    for _ in range(8):
        ds, res = engine.generate(params, ds)
        want.append(int(np.asarray(res.data)[0, 0]))

    import grpc

    req = jetstream_pb2.DecodeRequest
    with EngineServer(engine) as server, grpc.insecure_channel(
            f"127.0.0.1:{server.port}") as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        got_ids, got_text = [], ""
        for resp in stub.Decode(req(max_tokens=8, token_content=req.TokenContent(
                token_ids=ids)), timeout=120):
            for s in resp.stream_content.samples:
                got_ids += list(s.token_ids)
        for resp in stub.Decode(req(max_tokens=8, text_content=req.TextContent(text=text)),
                                timeout=120):
            for s in resp.stream_content.samples:
                got_text += s.text
    assert got_ids == want
    assert got_text == "".join(tok.decode([t]) for t in want)
