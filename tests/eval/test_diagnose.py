"""Eval diagnostics: file tags that keep differently drawn evals apart, the no-answer
warning's threshold and text, and why an answer was not graded."""

from tppo_jax.eval.diagnose import no_answer_warning, protocol_tag, why_not_graded
from tppo_jax.eval.protocol import EvalProtocol


def test_tags_differ_whenever_the_draw_differs():
    run = EvalProtocol("run", samples=4, temperature=1.0, top_p=1.0, max_tokens=64)
    tags = {protocol_tag(run.to_dict(), greedy=True),
            protocol_tag(run.to_dict()),
            protocol_tag(run.overridden(samples=8).to_dict()),
            protocol_tag(run.overridden(temperature=0.6).to_dict()),
            protocol_tag(run.overridden(top_p=0.7).to_dict())}
    assert len(tags) == 5
    assert protocol_tag(run.to_dict()) == "run-k4-t1-p1"
    assert protocol_tag(run.overridden(samples=0).to_dict()) == "greedy"
    assert protocol_tag(run.overridden(top_p=0.7).to_dict()) == "runx-k4-t1-p0.7"


def test_no_answer_warning_threshold_and_text():
    assert no_answer_warning(None, "boxed") is None
    assert no_answer_warning(90.0, "boxed") is None
    w = no_answer_warning(97.0, "answer_line")
    assert w.startswith("warning: 97% ") and "Answer: X" in w
    assert "reward.answer_format" in w and "data.prompt_template" in w and "\n" not in w


def test_why_not_graded():
    assert why_not_graded("ok", "boxed") is None and why_not_graded("wrong", "boxed") is None
    assert "\\boxed" in why_not_graded("no_answer", "boxed")
    assert "item_timeout_s" in why_not_graded("timeout", "boxed")
    assert why_not_graded("crash", "boxed")
