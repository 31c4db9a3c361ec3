"""The daily task's first-error classifier, on hand-written completions."""

from tppo_jax.benchmarks.daily_errors import first_error, tally

Q = "Q: Zoe has 3 coins. Each day she gets 2 more. How many coins after 3 days?\nA: "
RIGHT = "day 1 of 3: 3 + 2 = 5\nday 2 of 3: 5 + 2 = 7\nday 3 of 3: 7 + 2 = 9\n\\boxed{9}"


def test_each_first_error_is_named():
    assert first_error(Q, RIGHT) == "none"
    cases = {
        "day 1 of 3: 33 + 2 = 35": "start value copied wrong (line 1)",
        "day 1 of 8: 3 + 2 = 5": "day count copied wrong (line 1)",
        "day 1 of 3: 3 + 1 = 4": "step copied wrong (line 1)",
        "day 1 of 3: 3 + 2 = 6": "arithmetic slip (line 1)",
        "day 1 of 3: 3 + 2 = 5\nday 2 of 3: 6 + 2 = 8": "carried value wrong",
        "day 1 of 3: 3 + 2 = 5\nday 2 of 3: 5 + 2 = 8": "arithmetic slip (later line)",
        "day 1 of 3: 3 + 2 = 5\nday 3 of 3: 5 + 2 = 7": "day index wrong (later line)",
        "day 1 of 3: 3 + 2 = 5\n\\boxed{5}": "stopped early",
        RIGHT.replace("{9}", "{7}"): "boxed != last result",
        RIGHT.replace("\\boxed{9}", ""): "no boxed answer",
        "day 1 of 3: 3 +": "malformed (line 1)",
    }
    for completion, want in cases.items():
        assert first_error(Q, completion) == want, completion
    gives = Q.replace("gets 2 more", "gives away 1")
    assert first_error(gives, "day 1 of 3: 3 - 1 = 2\nday 2 of 3: 2 - 1 = 1\n"
                              "day 3 of 3: 1 - 1 = 0\n\\boxed{0}") == "none"
    assert first_error(gives, "day 1 of 3: 3 + 1 = 4") == "step copied wrong (line 1)"
    assert first_error("Q: 2 + 2?\nA: ", "4") == "unparsed"


def test_tally_reads_eval_show_output():
    def block(completion, grade):
        return f"=== prompt\n{Q}\n--- completion\n{completion}\n--- answer 9: {grade}\n\n"
    text = (block(RIGHT, "ok (reward 1)") + block("day 1 of 3: 33 + 2 = 35", "wrong (reward 0)")
            + block("day 1 of 3: 3 + 2 = 6", "wrong (reward 0)"))
    assert tally(text) == {"correct": 1, "start value copied wrong (line 1)": 1,
                           "arithmetic slip (line 1)": 1}


def test_generated_daily_problems_parse_and_classify_as_right():
    # The patterns restate the generator's question and line formats: its own reference
    # solutions must read as mistake-free, and a corrupted step as a slip on that line.
    from tppo_jax.data.synthetic import SyntheticMathTask

    task = SyntheticMathTask(seed=3, difficulty=5.0, max_steps=26, max_operand=2, max_value=40,
                         style="daily")
    for prob in task.problems(50):
        q, (lines, v) = prob.question(), task.solve(prob)
        assert first_error(q, "\n".join([*lines, f"\\boxed{{{v}}}"])) == "none", q
        wrong, _ = task.solve(prob, wrong_step=0, delta=1)
        assert first_error(q, wrong[0]) == "arithmetic slip (line 1)", q
