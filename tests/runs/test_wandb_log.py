"""W&B beside TensorBoard: an offline run (``WANDB_MODE=offline``) is read back from its
``.wandb`` transaction log (scalars per step, the samples table, the config, the run id a
resume reuses); a broken or missing wandb leaves metrics.jsonl going with one warning."""

from __future__ import annotations

import json
import logging
import struct
import sys
import time
from pathlib import Path

import pytest

from tppo_jax.config import Config, load_config
from tppo_jax.runs.metrics import MetricsWriter
from tppo_jax.runs.run_config import frozen
from tppo_jax.runs.wandb_log import ID_FILE, WandbSettings, wandb_settings

OFF = "W&B logging is off, metrics.jsonl goes on"
SAMPLE = {"prompt": "1+1?", "completion": "\\boxed{2}", "answer": "2", "reward": 1.0,
          "reason": "correct"}


def read_wandb_log(path: Path) -> list:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB-log records (CRC,
    length, type) in 32 KiB blocks, each a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    records, pos, body = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # FULL or LAST
            records.append(pb.Record.FromString(body))
            body = b""
    return records


def finished_log(path: Path, timeout_s: float = 30.0) -> list:
    """``path``'s records once they end with the run's exit record (wandb's service process
    may still be writing the file's tail when ``finish`` returns)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_wandb_log(path)
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record"
        time.sleep(0.1)


def offline_runs(wandb_dir: Path, run_id: str) -> list[dict]:
    """Per offline run of ``run_id`` (oldest first): its run record, config and history."""
    out = []
    for f in sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")):
        run, config, history = None, {}, {}
        for r in finished_log(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run = r.run
                config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in r.history.item}
                history.setdefault(row["_step"], {}).update(row)
        out.append({"run": run, "config": config, "history": history})
    return out


def test_an_offline_run_holds_the_steps_samples_and_config_and_a_resume_continues_it(
        tmp_path, wandb_offline):
    cfg = load_config(None, ["logging.wandb=true", "logging.wandb_project=tppo-test",
                             "logging.wandb_name=probe"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    m = MetricsWriter(run_dir, tensorboard=False, wandb=wandb_settings(cfg))
    for step in (1, 2, 3):
        m.write(step, {"reward_mean": step / 4, "loss": 1.0 / step, "note": "text"})
    m.write_samples(3, [SAMPLE])
    m.close()
    run_id = (run_dir / ID_FILE).read_text().strip()
    (first,) = offline_runs(wandb_offline, run_id)
    assert (first["run"].project, first["run"].display_name) == ("tppo-test", "probe")
    assert first["config"]["logging"]["wandb"] is True
    assert first["config"]["rollout"]["window"] == cfg.rollout.window
    h = first["history"]
    assert [h[s]["reward_mean"] for s in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert h[2]["loss"] == 0.5 and "note" not in h[2] and "step" not in h[2]
    assert h[3]["samples/_type"] == "table-file" and h[3]["samples/nrows"] == 1
    assert len(json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])) == 5
    # A resume of the run dir logs to the same W&B run (a second offline segment of it).
    m = MetricsWriter(run_dir, tensorboard=False, resume_step=2, wandb=wandb_settings(cfg))
    m.write(3, {"reward_mean": 0.7})
    m.write(4, {"reward_mean": 0.9})
    m.close()
    assert (run_dir / ID_FILE).read_text().strip() == run_id
    first, second = offline_runs(wandb_offline, run_id)
    assert second["run"].run_id == run_id
    assert {s: r["reward_mean"] for s, r in second["history"].items()} == {3: 0.7, 4: 0.9}


class _FlakyRun:
    """A wandb run whose second ``log`` fails (the network went away)."""

    id, step, url = "flaky", 0, None

    def __init__(self) -> None:
        self.logged, self.finished = [], False
        self.config = type("C", (), {"update": lambda *a, **k: None})()

    def log(self, data, step):
        if self.logged:
            raise ConnectionError("network is unreachable\nretrying")
        self.logged.append((step, data))

    def finish(self, exit_code=0):
        self.finished = True


def _train_three_steps(run_dir: Path, settings: WandbSettings | None) -> list[dict]:
    m = MetricsWriter(run_dir, tensorboard=False, wandb=settings)
    for step in (1, 2, 3):
        m.write(step, {"reward_mean": step / 4})
        m.write_samples(step, [SAMPLE])
    m.close()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("failure", ["init", "log", "not installed"])
def test_a_broken_wandb_leaves_jsonl_going_with_one_warning(tmp_path, monkeypatch, caplog,
                                                            failure):
    import wandb

    flaky = _FlakyRun()
    if failure == "init":
        def refuse(**kwargs):
            raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login")
        monkeypatch.setattr(wandb, "init", refuse)
    elif failure == "log":
        monkeypatch.setattr(wandb, "init", lambda **kwargs: flaky)
    else:
        monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with caplog.at_level(logging.WARNING):
        settings = wandb_settings(load_config(None, ["logging.wandb=true"]))
        rows = _train_three_steps(tmp_path, settings)
    assert [r["step"] for r in rows] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and OFF in warnings[0] and "\n" not in warnings[0], warnings
    if failure == "log":
        assert [(s, d["reward_mean"]) for s, d in flaky.logged] == [(1, 0.25)]
        assert flaky.finished


def test_wandb_is_off_by_default_and_may_change_on_resume(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import of wandb would fail
    assert wandb_settings(Config()) is None
    assert [r["step"] for r in _train_three_steps(tmp_path, None)] == [1, 2, 3]
    for key in ("logging.wandb", "logging.wandb_project", "logging.tensorboard"):
        assert not frozen(key)


def _tb_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` read back from the run's TensorBoard event files."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for f in sorted((run_dir / "tensorboard").glob("events.*")):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4  # length, its crc, the record, its crc
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_held_out_evals_reach_evals_jsonl_tensorboard_and_wandb(tmp_path, wandb_offline):
    """Before / during / after evals: each one line of evals.jsonl with its step; before
    and after also to TensorBoard and W&B as eval_<key> at their step (during ones reach
    them through the step's metrics row)."""
    cfg = load_config(None, ["logging.wandb=true", "logging.wandb_project=tppo-test"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    m = MetricsWriter(run_dir, tensorboard=True, wandb=wandb_settings(cfg))
    m.write_eval(0, "before", {"accuracy": 10.0, "greedy_accuracy": 20.0, "mask": "x."})
    m.write(1, {"reward_mean": 0.5})
    m.write(2, {"reward_mean": 0.75, "eval_accuracy": 30.0})
    m.write_eval(2, "during", {"accuracy": 30.0}, loggers=False)
    m.write_eval(2, "after", {"accuracy": 40.0, "greedy_accuracy": 50.0})
    m.close()
    rows = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [(r["step"], r["which"], r["accuracy"]) for r in rows] == [
        (0, "before", 10.0), (2, "during", 30.0), (2, "after", 40.0)]
    tb = _tb_scalars(run_dir)
    assert tb["eval_accuracy"] == {0: 10.0, 2: 40.0}  # the after eval is the last at step 2
    assert tb["eval_greedy_accuracy"] == {0: 20.0, 2: 50.0}
    (run,) = offline_runs(wandb_offline, (run_dir / ID_FILE).read_text().strip())
    h = run["history"]
    assert h[0]["eval_accuracy"] == 10.0 and h[2]["eval_greedy_accuracy"] == 50.0
    assert "eval_mask" not in h[0]


def test_tensorboard_tags_are_the_metrics_jsonl_keys(tmp_path):
    """``avg@4`` keeps its ``@`` in TensorBoard (tensorboardX's add_scalar would write
    ``avg_4``): one name for a metric in metrics.jsonl, TensorBoard and W&B."""
    m = MetricsWriter(tmp_path, tensorboard=True)
    m.write(1, {"eval_avg@4": 62.5, "eval_pass@4": 90.0, "reward_mean": 0.5})
    m.write_eval(1, "after", {"avg@4": 70.0})
    m.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    tb = _tb_scalars(tmp_path)
    assert {k for k in row if k not in ("step", "wall_time")} <= set(tb)
    assert tb["eval_avg@4"] == {1: 70.0} and tb["eval_pass@4"] == {1: 90.0}
    assert not any("_4" in tag for tag in tb)
