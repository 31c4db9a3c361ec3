"""Process rewards under truncation: an unfinished row's completed lines are judged in the
window that wrote them (T-PPO's policy trains on that window only), a cut last line waits,
and a finished row is judged whole; the all-steps-valid rate counts finished rows only."""

import numpy as np

from tppo_jax.config import load_config
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.tokenizer import train_sentencepiece
from tppo_jax.rollout.scheduler import RolloutBatch
from tppo_jax.train.collect import step_process_rewards

PROMPT = "Q: Max has 5 toys. Each day he gets 1 more. How many toys after 3 days?\nA:"


def _batch(tok, responses, finished, window_starts):
    """Rows of ``PROMPT`` + response; the current window begins at ``window_starts`` tokens
    into the response."""
    p = tok.encode(PROMPT)
    rows = [p + tok.encode(r) for r in responses]
    s = max(map(len, rows)) + 4
    tokens = np.zeros((len(rows), s), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    n = len(rows)
    plen = np.full(n, len(p))
    start = plen + np.asarray(window_starts)
    wlen = np.array([len(r) for r in rows]) - start
    return RolloutBatch(tokens, plen, start, wlen, np.asarray(finished), np.zeros(n, int),
                        np.zeros((n, s), np.float32), np.zeros((n, s), np.int32),
                        np.arange(n), [None] * n)


def test_unfinished_rows_get_their_completed_lines_judged(tmp_path):
    corpus = SyntheticMathTask(seed=0, style="daily", max_operand=2, max_value=40,
                               max_steps=6).teacher_corpus(300, 0.0, 0.0)
    tok = train_sentencepiece(corpus, tmp_path / "tok", vocab_size=96)
    cfg = load_config(None, ["reward.process=first_error", "reward.process_penalty=-0.5"])
    responses = [
        "day 1 of 3: 5 + 1 = 6\nday 2 of 3: 6 + 1 = 8\nday 3 of 3: 8 + 1 = 9\n\\boxed{9}",
        "day 1 of 3: 5 + 1 = 7\nday 2 of",  # unfinished: line 1 wrong and complete
        "day 1 of 3: 5 + 1 = 7",  # unfinished: its only line may still go on
        "day 1 of 3: 5 + 1 = 6\nday 2 of 3: 6 + 1 = 7\n",  # unfinished, no slip yet
    ]
    rb = _batch(tok, responses, [True, False, False, False], [0, 0, 0, 0])
    out, valid = step_process_rewards(cfg, tok, rb, np.array([0]))
    resp = [out[i, rb.prompt_len[i]:rb.total_len[i]] for i in range(4)]
    assert valid == 0.0  # the one finished row has a slip
    # Finished: one penalty, on the last token of line 2 ("8").
    (pos,) = np.flatnonzero(resp[0])
    assert resp[0][pos] == -0.5
    ids = rb.response_tokens(0)
    assert tok.decode(ids[:pos + 1]).endswith("6 + 1 = 8")
    # Unfinished with a complete wrong line: penalised now, at that line's last token.
    (pos,) = np.flatnonzero(resp[1])
    assert resp[1][pos] == -0.5 and tok.decode(rb.response_tokens(1)[:pos + 1]).endswith("= 7")
    assert not resp[2].any() and not resp[3].any()
    # No finished row: rewards still come (row 0's slip is on a completed line), and there is
    # no validity rate.
    out, valid = step_process_rewards(cfg, tok, rb, np.array([], int))
    assert valid is None and out[0].sum() == out[1].sum() == -0.5 and not out[2:].any()


def test_blame_starts_at_the_first_invalid_step(tmp_path):
    from tppo_jax.train.collect import blame_starts

    corpus = SyntheticMathTask(seed=0, style="daily", max_operand=2, max_value=40,
                               max_steps=6).teacher_corpus(300, 0.0, 0.0)
    tok = train_sentencepiece(corpus, tmp_path / "tok", vocab_size=96)
    responses = [
        "day 1 of 3: 5 + 1 = 6\nday 2 of 3: 6 + 1 = 8\nday 3 of 3: 8 + 1 = 9\n\\boxed{9}",
        "day 1 of 3: 5 + 1 = 7\nday 2 of 3: 7 + 1 = 8\n\\boxed{8}",  # the first line slips
        "day 1 of 3: 5 + 1 = 6\n\\boxed{5}",  # the answer line contradicts line 1
        "day 1 of 3: 5 + 1 = 6\nday 2 of 3: 6 + 1 = 9\n\\boxed{9}",  # not in `wrong`
        "day 1 of 3: 5 + 1 = 6\nday 2 of 3: 6 + 1 = 7\nday 3 of 3: 7 + 1 = 8\n\\boxed{9}",
    ]
    rb = _batch(tok, responses, [True] * 5, [0] * 5)
    start = blame_starts(tok, rb, np.array([0, 1, 2, 4]))  # row 3 is not wrong
    plen = rb.prompt_len
    first = tok.decode(rb.tokens[0, plen[0]:start[0]])
    assert first.rstrip("\n") == "day 1 of 3: 5 + 1 = 6"  # right line 1 spared, line 2 blamed
    assert tok.decode(rb.tokens[0, start[0]:rb.total_len[0]]).lstrip("\n").startswith("day 2")
    assert start[1] == plen[1]  # the first line slips: the whole response is blamed
    assert tok.decode(rb.tokens[2, start[2]:rb.total_len[2]]).lstrip("\n") == "\\boxed{5}"
    assert start[3] == 0  # not a wrong row: every column
    # every line right, the answer line wrong: only the answer line is blamed
    assert tok.decode(rb.tokens[4, start[4]:rb.total_len[4]]).lstrip("\n") == "\\boxed{9}"
