"""Bad command-line arguments and inputs of `tppo eval / export / plot / data` are one-line
errors with a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from tppo_jax.cli import main
from tppo_jax.cli.args import non_negative_float, non_negative_int, positive_int, top_p
from tppo_jax.config import load_config
from tppo_jax.data.readers import DataError, read_examples


# ---- the argparse types ---------------------------------------------------------------
@pytest.mark.parametrize(("parse", "text"), [
    (positive_int, "0"), (positive_int, "-3"), (positive_int, "x"), (positive_int, "9" * 5000),
    (positive_int, str(2**31)), (non_negative_int, "-1"), (non_negative_int, "1.5"),
    (non_negative_float, "-1"), (non_negative_float, "nan"), (non_negative_float, "inf"),
    (non_negative_float, "warm"), (top_p, "0"), (top_p, "1.01"), (top_p, "-0.5"),
    (top_p, "nan"),
])
def test_bad_argument_values_are_refused(parse, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        parse(text)
    assert "\n" not in str(e.value) and len(str(e.value)) < 120


def test_good_argument_values_parse() -> None:
    assert positive_int("8") == 8 and non_negative_int("0") == 0
    assert non_negative_float("0") == 0.0 and top_p("1") == 1.0 and top_p("0.7") == 0.7


@pytest.mark.parametrize(("argv", "needle"), [
    (["eval", "RUN", "-k", "0"], "argument -k"),
    (["eval", "RUN", "--temperature", "-1"], "argument --temperature"),
    (["eval", "RUN", "--top-p", "0"], "argument --top-p"),
    (["eval", "RUN", "--top-p", "1.5"], "argument --top-p"),
    (["eval", "RUN", "--step", "-1"], "argument --step"),
    (["eval", "RUN", "--show", "-2"], "argument --show"),
    (["export", "RUN", "OUT", "--step", "x"], "argument --step"),
    (["plot", "RUN", "--smooth", "0"], "argument --smooth"),
    (["data", "-n", "-1"], "argument -n"),
])
def test_cli_refuses_bad_arguments_before_running(argv, needle, capsys) -> None:
    with pytest.raises(SystemExit) as e:  # argparse: the command never starts
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert needle in last and "Traceback" not in err, err


# ---- a checkpoint step that does not exist --------------------------------------------
def _run_with_checkpoint(run: Path, step: int) -> None:
    from tppo_jax.runs.checkpoint import Checkpointer

    run.mkdir()
    (run / "config.yaml").write_text(load_config("smoke").to_yaml())
    ck = Checkpointer(run / "checkpoints", every=1, keep=5)
    try:
        ck.save(step, {"policy": {"w": np.zeros(3, np.float32)}}, {"step": step}, force=True)
    finally:
        ck.close()


@pytest.mark.parametrize("command", [["eval"], ["export"]])
def test_missing_step_names_the_saved_steps(tmp_path: Path, capsys, command) -> None:
    run = tmp_path / "run"
    _run_with_checkpoint(run, 2)
    argv = [*command, str(run), *(["OUT"] if command == ["export"] else []), "--step", "5"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "no checkpoint of step 5" in err and "saved steps: 2" in err, err
    assert "DAMAGED" not in err


# ---- tppo plot on a damaged metrics.jsonl -----------------------------------------------
BAD_LINES = [b"[1, 2]", b"5", b'"text"', b"\xff\xfe{", b'{"step": 1', b"9" * 5000,
             b"[" * 5000, b'{"step": "x", "wall_time": 1, "reward_mean": 0.5}',
             b'{"step": 3, "reward_mean": 0.5}', b'{"step": 4, "wall_time": 4, "reward_mean": '
             + b"1" * 400 + b"}", b'{"step": true, "wall_time": 2, "reward_mean": 0.1}']


def test_plot_skips_bad_lines_with_one_warning(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    good = [json.dumps({"step": s, "wall_time": 10.0 * s, "reward_mean": 0.1 * s,
                        "accuracy": 0.5}).encode() for s in (1, 2)]
    (run / "metrics.jsonl").write_bytes(b"\n".join([good[0], *BAD_LINES, good[1]]) + b"\n")
    assert main(["plot", str(run)]) == 0
    out, err = capsys.readouterr()
    assert (run / "metrics_vs_step.png").is_file() and (run / "metrics_vs_time.png").is_file()
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "7 unreadable line(s) skipped" in err, err


def test_plot_refuses_a_directory_as_metrics(tmp_path: Path, capsys) -> None:
    (tmp_path / "metrics.jsonl").mkdir()
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


# ---- a directory as data.source -------------------------------------------------------
def test_directory_as_data_source_is_a_data_error(tmp_path: Path) -> None:
    d = tmp_path / "rows.jsonl"
    d.mkdir()
    with pytest.raises(DataError, match="not a regular file"):
        read_examples(d)


@pytest.mark.parametrize("content", ["empty", "no data files"])
def test_a_folder_that_holds_no_dataset_is_one_line(tmp_path: Path, content: str) -> None:
    """What ``tppo train data.source=FOLDER`` reads: ``read_source`` on a directory."""
    from tppo_jax.data.sources import read_source

    d = tmp_path / "rows"
    d.mkdir()
    if content == "no data files":
        (d / "notes.txt.bak").write_bytes(b"\x00\x01 not a table")
    with pytest.raises(DataError) as e:
        read_source(str(d))
    assert str(d) in str(e.value) and "\n" not in str(e.value)


def test_overrides_are_accepted_after_options(capsys) -> None:
    """Issue 62 L-9: ``tppo data preview --config X key=value`` and ``tppo plan CONFIG
    --topology T --compile key=value`` failed with "unrecognized arguments"."""
    from tppo_jax import cli

    cli._register_optional()
    parser = cli.build_parser()
    args = cli.parse_args(parser, ["data", "preview", "--config", "smoke", "data.seed=3"])
    assert args.config == "smoke" and args.overrides == ["data.seed=3"]
    args = cli.parse_args(parser, ["plan", "smoke", "train.steps=2", "--topology", "v5e:2x2",
                                   "--compile", "rollout.window=32"])
    assert args.overrides == ["train.steps=2", "rollout.window=32"] and args.compile
    for argv in (["data", "preview", "--bogus"], ["data", "preview", "-n", "1", "stray"]):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(parser, argv)
        assert e.value.code == 2
    assert "unrecognized arguments: " in capsys.readouterr().err
