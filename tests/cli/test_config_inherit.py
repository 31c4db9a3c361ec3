"""Configs inherit (``base:`` + overrides, deep-merged), shipped configs resolve to what they
resolved to before they were rewritten as differences, and duplicate YAML keys are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tppo_jax.config import ConfigError, configs_dir, load_config, read_config_file

SNAPSHOT = Path(__file__).parents[1] / "fixtures" / "resolved_configs.json"


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{"section.key": value}``, JSON-normalised (tuples -> lists) as the snapshot stores."""
    out: dict[str, object] = {}
    for k, v in json.loads(json.dumps(tree)).items():
        if isinstance(v, dict) and not prefix:
            out.update(_flat(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_every_shipped_config_resolves_as_snapshotted() -> None:
    # Taken at 94acf21, before ppo.yaml and the Qwen configs became differences from a base.
    # Compared on the keys both have: a key added since (at its default) or removed since
    # does not count; a shipped config's value for an existing key must not move.
    snap = json.loads(SNAPSHOT.read_text())
    shipped = sorted(p.stem for p in configs_dir().glob("*.yaml"))
    assert shipped == sorted(snap), "a shipped config was added or removed: update the snapshot"
    moved = {}
    for name in shipped:
        now, then = _flat(load_config(name).to_dict()), _flat(snap[name])
        moved.update({f"{name}: {k}": (then[k], now[k]) for k in now.keys() & then.keys()
                      if now[k] != then[k]})
    assert moved == {}, "(snapshot, now)"


def test_base_is_deep_merged_along_a_chain(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: default\nrollout:\n  window: 64\n")
    (tmp_path / "b.yaml").write_text("base: a\nalgo:\n  kl_coef: 0.1\n")
    cfg = load_config(tmp_path / "b.yaml", ["train.steps=3"])
    default = load_config("default")
    assert cfg.rollout.window == 64  # from a
    assert cfg.rollout.prompts_per_step == default.rollout.prompts_per_step  # from default
    assert cfg.algo.kl_coef == 0.1 and cfg.algo.nll_coef == default.algo.nll_coef
    assert cfg.train.steps == 3  # command-line overrides apply last
    assert "base" not in read_config_file(tmp_path / "b.yaml")


def test_a_base_can_be_a_path(tmp_path: Path) -> None:
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "parent.yaml").write_text("base: ppo\ntrain:\n  steps: 7\n")
    (tmp_path / "child.yaml").write_text("base: sub/parent.yaml\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.train.steps == 7 and cfg.rollout.num_windows == 1


@pytest.mark.parametrize("files, needle", [
    ({"a": "base: b\n", "b": "base: a\n"}, r"'base' chain loops \(a.yaml -> b.yaml -> a.yaml\)"),
    ({"a": "base: a\n"}, r"loops \(a.yaml -> a.yaml\)"),
    ({"a": "base: 3\n"}, "'base' must name a config"),
    ({"a": "base: nowhere\n"}, r"a.yaml: 'base': config file 'nowhere' not found"),
])
def test_bad_bases_are_refused_in_one_line(tmp_path: Path, files: dict, needle: str) -> None:
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(tmp_path / "a.yaml")
    assert "\n" not in str(e.value)


def test_duplicate_keys_are_refused_naming_the_key_and_both_lines(tmp_path: Path) -> None:
    p = tmp_path / "dup.yaml"
    p.write_text("rollout:\n  window: 64\nalgo:\n  kl_coef: 0.1\nrollout:\n  window: 16\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'rollout' at lines 1 and 5") as e:
        load_config(p)
    assert str(e.value).startswith(str(p)) and "\n" not in str(e.value)


def test_duplicate_nested_keys_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "dup.yaml"
    p.write_text("rollout:\n  window: 64\n  group_size: 2\n  window: 16\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'window' at lines 2 and 4"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"duplicate key 'a' at lines 1 and 1"):
        load_config(None, ["data.fields={a: 1, a: 2}"])


def test_cli_prints_a_duplicate_key_in_one_line(tmp_path: Path) -> None:
    p = tmp_path / "dup.yaml"
    p.write_text("train:\n  steps: 2\ntrain:\n  steps: 3\n")
    r = subprocess.run([sys.executable, "-m", "tppo_jax.cli", "config", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "duplicate key 'train' at lines 1 and 3" in r.stderr


def test_a_name_is_the_shipped_config_a_path_is_a_file(tmp_path, monkeypatch, caplog) -> None:
    """Issue 62 L-8: a folder named ``default`` or ``smoke`` in the working directory broke
    ``tppo train``; a file named ``smoke`` silently replaced the shipped config."""
    import logging

    from tppo_jax.config import resolve_config_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    (tmp_path / "smoke").write_text("train:\n  steps: 777\n")
    with caplog.at_level(logging.WARNING):
        assert load_config(None).train.steps != 777  # the shipped default, not the folder
        assert load_config("smoke").train.steps != 777
    assert resolve_config_path("smoke") == configs_dir() / "smoke.yaml"
    assert "not ./smoke in the working directory" in caplog.text
    assert load_config("./smoke").train.steps == 777  # a path when written as one
    (tmp_path / "mine").write_text("train:\n  steps: 5\n")
    assert load_config("mine").train.steps == 5  # no shipped config of that name
    with pytest.raises(ConfigError, match="not found"):
        load_config("nowhere/x.yaml")


def test_a_long_base_loop_is_one_short_line(tmp_path) -> None:
    """Issue 62 L-8: a 3,000-file ``base:`` loop gave a 41 KB error line (300 here)."""
    n = 300  # 2.4 KB of names uncapped
    for i in range(n):
        (tmp_path / f"c{i}.yaml").write_text(f"base: c{(i + 1) % n}.yaml\n")
    with pytest.raises(ConfigError) as e:
        read_config_file(tmp_path / "c0.yaml")
    msg = str(e.value)
    assert "chain loops (c0.yaml -> c1.yaml -> c2.yaml -> ... 295 more ..." in msg
    assert len(msg) < 600 and "\n" not in msg
