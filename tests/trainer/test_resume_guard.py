"""A resume that can never train the wrong model: the run's config.yaml is read strictly
(empty, truncated or unreadable: one line, nothing rewritten), every key that shapes the
tokenizer, warm-start, model, checkpointed state or data order is refused (the list in
``run_config``, checked here key by key against the documented one), ``data.on_bad_row``
changes without a new warm-start, and a resume that finds no usable checkpoint refuses
(unless ``--start-over``) instead of starting at step 0 over the run's logs."""

import json
import logging

import pytest

from tppo_jax import cli
from tppo_jax.config import Config, ConfigError, load_config
from tppo_jax.runs.run_config import (
    END_MARKER,
    _flat,
    frozen,
    resume_config,
    run_config_text,
)
from tppo_jax.runs.run_dir import resolve_run_dir
from tppo_jax.weights import warmstart


def start_problem(rd, resume):
    from tppo_jax.runs.run_claim import start_problem

    return start_problem(rd, resume)


def _run_dir_error():
    from tppo_jax.runs.run_dir import RunDirError

    return RunDirError

SMALL = ["train.warmstart_steps=2", "data.eval_size=4", "logging.tensorboard=false",
         "train.compile_cache=", "train.steps=2"]


@pytest.fixture
def run(tmp_path):
    cfg = load_config("smoke", SMALL)
    path = tmp_path / "runs" / "r"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(run_config_text(cfg))
    return path, cfg


def _metrics(path, n):
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward_mean": 0.5}) + "\n"
                                                for i in range(1, n + 1)))


# ---- 1. config.yaml is read strictly ----------------------------------------------------
def _cut_mid_line(text):
    i = len(text) // 2
    while text[i - 1] == "\n":
        i += 1
    return text[:i]


def _cut_at_line(text):
    lines = text.splitlines(keepends=True)
    return "".join(lines[: len(lines) // 2])


BAD = {
    "empty": lambda t: "",
    "blank": lambda t: "\n\n  \n",
    "cut inside a line": _cut_mid_line,
    "cut at a line end": _cut_at_line,
    "cut after the last header": lambda t: t[: t.index("\ntrain:") + len("\ntrain:\n")],
    # a line end inside the last section: every section there and non-empty, train.seed lost
    "cut inside the last section": lambda t: t[: t.index("\n", t.index("\ntrain:\n") + 8) + 1],
    "not a mapping": lambda t: "- model\n- data\n",
    "invalid YAML": lambda t: "model: [1, 2\n",
    "a YAML bomb": lambda t: 'a: &a ["x", "x"]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n' + t,
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_damaged_config_yaml_is_refused_in_one_line(run, name):
    path, _ = run
    text = BAD[name]((path / "config.yaml").read_text())
    (path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        resume_config(str(path), None, [])
    msg = str(e.value)
    assert str(path / "config.yaml") in msg and "\n" not in msg and "nothing was changed" in msg
    assert (path / "config.yaml").read_text() == text


@pytest.mark.parametrize("kind", ["a folder", "not UTF-8"])
def test_an_unreadable_config_yaml_is_refused(run, kind):
    path, _ = run
    (path / "config.yaml").unlink()
    if kind == "a folder":
        (path / "config.yaml").mkdir()
    else:
        (path / "config.yaml").write_bytes(b"model:\n  source: \xff\xfe\n")
    with pytest.raises(ConfigError, match="cannot be read") as e:
        resume_config(str(path), None, [])
    assert "\n" not in str(e.value) and str(path / "config.yaml") in str(e.value)


@pytest.mark.parametrize("marker", [True, False], ids=["whole file", "older version"])
def test_missing_keys_of_an_older_config_are_said(run, caplog, marker):
    path, saved = run
    text = (path / "config.yaml").read_text().replace("  advantage_baseline: critic\n", "")
    (path / "config.yaml").write_text(text if marker else text.replace(END_MARKER, ""))
    with caplog.at_level(logging.WARNING):
        assert resume_config(str(path), None, []) == saved
    assert "has no algo.advantage_baseline: using its default 'critic'" in caplog.text


def test_a_missing_frozen_key_is_refused_unless_the_file_is_whole(run, caplog):
    path, saved = run
    text = (path / "config.yaml").read_text().replace("  seed: 0\n", "", 1)
    (path / "config.yaml").write_text(text.replace(END_MARKER, ""))
    with pytest.raises(ConfigError, match=r"has no data.seed \(truncated\?\)") as e:
        resume_config(str(path), None, [])
    assert "\n" not in str(e.value)
    (path / "config.yaml").write_text(text)  # ended by the marker: a key an older run lacked
    with caplog.at_level(logging.WARNING):
        assert resume_config(str(path), None, []) == saved


def test_a_refused_change_quotes_short_prefixes(run):
    path, _ = run
    with pytest.raises(ConfigError) as e:
        resume_config(str(path), None, [f"data.prompt_template={'x' * 100_000}"])
    assert len(str(e.value)) < 400 and "data.prompt_template" in str(e.value)


def test_the_cli_refuses_an_empty_config_yaml_and_writes_nothing(run, capsys):
    path, _ = run
    (path / "config.yaml").write_text("")
    rc = cli.main(["train", "--run-dir", str(path), "--resume", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "config.yaml is empty" in err
    assert (path / "config.yaml").read_text() == ""
    assert sorted(p.name for p in path.iterdir()) == ["config.yaml"]  # no warm-start, no lock
    assert not list(path.parent.glob("warmstart-*"))


# ---- 2. frozen keys, key by key, against the documented list -------------------------
# README: "keys the checkpoint or the data order depend on (`model.*`, `data.*` except
# `on_bad_row`, `rollout` slots, lengths, window and cache layout, `train.seed`,
# `train.warmstart_*`) are refused in one line".
DOCUMENTED_ROLLOUT = {"prompts_per_step", "group_size",  # slots
                      "max_prompt_len", "max_response_len",  # lengths
                      "window", "kv_policy", "kv_cache", "page_size", "num_pages"}


def documented_frozen(key: str) -> bool:
    section, name = key.split(".", 1)
    if section in ("model", "data"):
        return key != "data.on_bad_row"
    if section == "rollout":
        return name in DOCUMENTED_ROLLOUT
    return section == "train" and (name == "seed" or name.startswith("warmstart_"))


EVERY_KEY = sorted(_flat(Config().to_dict()))


@pytest.mark.parametrize("key", EVERY_KEY)
def test_frozen_matches_the_documented_list(key):
    assert frozen(key) == documented_frozen(key), key


def test_every_documented_rollout_key_exists():
    assert {k.split(".", 1)[1] for k in EVERY_KEY if k.startswith("rollout.")} >= DOCUMENTED_ROLLOUT


@pytest.mark.parametrize("override", ["train.warmstart_no_format_frac=0.5",
                                      "train.warmstart_wrong_step_frac=0.3",
                                      "train.warmstart_batching=by_length", "data.max_operand=5",
                                      "rollout.page_size=8", "model.remat=true"])
def test_a_resume_refuses_every_warmstart_and_shape_key(run, override):
    path, _ = run
    with pytest.raises(ConfigError) as e:
        resume_config(str(path), None, [override])
    assert override.split("=")[0] in str(e.value) and "\n" not in str(e.value)


# ---- data.on_bad_row: allowed, and no new warm-start ---------------------------------
def test_on_bad_row_does_not_change_the_warmstart_key(run):
    path, cfg = run
    skip = resume_config(str(path), None, ["data.on_bad_row=skip"])
    assert skip.data.on_bad_row == "skip"
    assert warmstart.warmstart_key(skip) == warmstart.warmstart_key(cfg)


def test_changing_on_bad_row_reuses_the_runs_own_warmstart(run, monkeypatch):
    path, cfg = run
    own = path / warmstart.RUN_SUBDIR
    own.mkdir()
    (own / "DONE").write_text(json.dumps({"key": warmstart.warmstart_key(cfg)}))
    monkeypatch.setattr(warmstart, "_train", lambda *a: pytest.fail("warm-start re-run"))
    monkeypatch.setattr(warmstart, "_load", lambda cfg, folder, mesh: ("tok", "policy"))
    skip = load_config("smoke", [*SMALL, "data.on_bad_row=skip"])
    assert warmstart.run_warmstart(skip, path, progress=False) == ("tok", "policy", own)
    # A copy an earlier version made for the skip config (its key hashed "skip") still counts.
    (own / "DONE").write_text(json.dumps({"key": warmstart._key(skip, "skip")}))
    assert warmstart.run_copy(skip, path) == own
    assert warmstart.run_copy(load_config("smoke", [*SMALL, "train.warmstart_steps=3"]),
                              path) is None


# ---- 3. no usable checkpoint: refuse, unless --start-over ------------------------------
def test_resume_with_every_checkpoint_set_aside_is_refused(run):
    path, _ = run
    _metrics(path, 8)
    for s in ("2", "4"):
        (path / "checkpoints" / f"{s}.damaged").mkdir(parents=True)
    with pytest.raises(_run_dir_error()) as e:
        start_problem(resolve_run_dir(path), resume=True)
    msg = str(e.value)
    assert "\n" not in msg and "no usable checkpoint" in msg and "--start-over" in msg
    assert "4.damaged, 2.damaged" in msg and "metrics.jsonl (8 rows)" in msg


def test_resume_with_another_checkpoint_dir_is_refused(run, tmp_path):
    path, _ = run
    _metrics(path, 3)
    (path / "checkpoints" / "2").mkdir(parents=True)
    with pytest.raises(_run_dir_error()) as e:
        start_problem(resolve_run_dir(path, str(tmp_path / "new")), resume=True)
    assert f"{path / 'checkpoints'} has step 2: is checkpoint.dir right?" in str(e.value)


def test_resume_of_a_run_with_nothing_to_lose_starts(run):
    path, _ = run  # config.yaml only: stopped before its first step
    start_problem(resolve_run_dir(path), resume=True)
    start_problem(resolve_run_dir(path.parent / "new"), resume=True)


def test_the_cli_refuses_and_keeps_every_row(run, capsys):
    path, _ = run
    _metrics(path, 8)
    (path / "checkpoints" / "4.damaged").mkdir(parents=True)
    before = (path / "metrics.jsonl").read_text()
    rc = cli.main(["train", "--run-dir", str(path), "--resume", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not any("Traceback" in x for x in err), err
    assert err[-1].startswith("tppo train: refused: --resume found no usable checkpoint")
    assert (path / "metrics.jsonl").read_text() == before
    assert not (path / "warmstart").exists()


def test_start_over_moves_the_logs_aside_and_never_discards_a_checkpoint(run):
    from tppo_jax.cli.train import start_over
    from tppo_jax.runs.run_dir import found_logs

    path, _ = run
    _metrics(path, 8)
    (path / "samples.jsonl").write_text('{"step": 1}\n')
    rd = resolve_run_dir(path)
    start_over(rd)
    assert found_logs(rd) == [] and not (path / "config.yaml").exists()
    (aside,) = path.glob("replaced-*")
    assert len((aside / "metrics.jsonl").read_text().splitlines()) == 8
    assert (aside / "samples.jsonl").exists() and (aside / "config.yaml").exists()
    start_problem(rd, resume=False)  # a new run may start here now
    (path / "checkpoints" / "6").mkdir(parents=True)
    with pytest.raises(_run_dir_error(), match="never discards"):
        start_over(rd)


def test_start_over_is_in_the_help():
    cli._register_optional()
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices["train"].format_help()
    assert "--start-over" in text and "replaced-" in text


# ---- logs are never truncated by a resume ----------------------------------------------
def test_resume_drops_only_rows_past_the_step_and_rewrites_atomically(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from tppo_jax.runs.metrics import MetricsWriter

    _metrics(tmp_path, 6)
    with (tmp_path / "metrics.jsonl").open("ab") as f:  # rows no resume may choke on
        f.write(b'{"step": "x"}\n{"step": null, "wall_time": "y"}\n{"step": 1' + b"9" * 5000
                + b'}\n\xff\xfe\n{"step": 7, "rew')  # the last cut by a kill
    m = MetricsWriter(tmp_path, tensorboard=False, resume_step=4)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, "x", None] and m.last["step"] is None
    # A full disk during the rewrite leaves the file as it was, never half of it.
    before = (tmp_path / "metrics.jsonl").read_text()
    real = Path.write_text

    def full(self, text, *a, **k):
        real(self, text[: len(text) // 3], *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError):
        MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left
