"""``tppo serve RUN`` serves as the run was configured: its ``config.yaml`` sets the lengths,
the dtype and the sampling (``--config`` replaces it, ``key=value`` goes on top), RUN and
``--checkpoint`` name the same thing, and chat requests are rendered in the run's prompt
format. Argument handling only: no model is loaded."""

import pytest

from tppo_jax.cli import _register_optional, build_parser
from tppo_jax.cli.serve import _take_run_arg, serving_config
from tppo_jax.config import load_config
from tppo_jax.serve.chat import chat_renderer


@pytest.fixture
def run(tmp_path):
    cfg = load_config(None, ["rollout.max_prompt_len=64", "rollout.max_response_len=160",
                             "model.dtype=bfloat16", "rollout.temperature=0.7"])
    d = tmp_path / "my-run"
    d.mkdir()
    (d / "config.yaml").write_text(cfg.to_yaml())
    return d


def _args(argv):
    _register_optional()
    args = build_parser().parse_args(["serve", *argv])
    return args, _take_run_arg(args)


def test_serve_run_takes_the_runs_config(run):
    default = load_config()
    assert default.rollout.max_prompt_len != 64  # (else this test shows nothing)
    for argv in ([str(run)], ["--checkpoint", str(run)]):
        args, err = _args(argv)
        cfg = serving_config(args)
        assert err is None and args.checkpoint == str(run)
        assert (cfg.rollout.max_prompt_len, cfg.rollout.max_response_len, cfg.model.dtype,
                cfg.rollout.temperature) == (64, 160, "bfloat16", 0.7)
    args, _ = _args([str(run), "rollout.temperature=0"])
    assert serving_config(args).rollout.temperature == 0  # overrides on top of the run's
    args, _ = _args([str(run), "--config", "default"])
    assert serving_config(args).rollout.max_prompt_len == default.rollout.max_prompt_len


@pytest.mark.parametrize("argv,words", [
    (["a", "b"], "one RUN to serve"),
    (["a", "--checkpoint", "b"], "give one"),
])
def test_two_things_to_serve_are_refused(argv, words):
    assert words in _args(argv)[1]


class _Tok:
    chat_template = None
    bos_token = eos_token = ""


def test_chat_requests_use_the_runs_prompt_format():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}]
    tiny = chat_renderer(load_config(None, ["model.source=tiny"]), _Tok())
    assert tiny(msgs) == "Q: 1+2?\nA: "  # the tiny model's format, as it trained
    tok = _Tok()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    cfg = load_config(None, ["model.source=hf", "model.path=x", "data.system_prompt=Sys"])
    assert chat_renderer(cfg, tok)(msgs[1:]) == "<system>Sys<user>1+2?"
    assert chat_renderer(cfg, tok)(msgs) == "<system>Be brief.<user>1+2?"
    off = load_config(None, ["model.source=hf", "model.path=x", "data.chat_template=false"])
    assert chat_renderer(off, tok)(msgs[1:]) == "1+2?\nSolution:"
