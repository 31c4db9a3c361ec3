"""``tppo eval RUN`` prints one line a person reads (the JSON report holds the rest)."""

from pathlib import Path

from tppo_jax.cli.runs import eval_summary


def test_sampled_and_greedy_summaries():
    sampled = {"k": 4, "step": 30, "start": False, "greedy": False, "questions": 127,
               "avg@4": 85.23, "pass@4": 96.06, "no_answer": 0.0,
               "protocol": {"name": "run", "temperature": 1.0, "top_p": 1.0}}
    assert eval_summary(sampled, Path("runs/r1")) == (
        "r1 step 30: 127 held-out questions, run protocol, k=4, temperature 1, top_p 1: "
        "avg@4 85.2%, pass@4 96.1%")
    greedy = {"k": 1, "step": 0, "start": True, "greedy": True, "questions": 127,
              "avg@1": 97.64, "pass@1": 97.64, "no_answer": 1.57, "protocol": None}
    assert eval_summary(greedy, Path("r1")) == (
        "r1 start: 127 held-out questions, greedy: accuracy 97.6%, no answer 1.6%")
