"""Offline stand-ins for the Hugging Face caches, written with the libraries' own formats.

Two layouts a user's machine can hold a Hub dataset in, each with nothing on the network:

- ``prepared_cache``: what ``datasets.load_dataset("owner/name", config)`` leaves in
  ``HF_DATASETS_CACHE`` after an online load (``owner___name/<config>/0.0.0/<hash>/`` with
  ``dataset_info.json`` and ``<name>-<split>.arrow``), made here by the library's own Parquet
  builder; offline, ``load_dataset`` reads it back.
- ``hub_snapshot``: what ``hf download --repo-type dataset owner/name`` leaves in
  ``HF_HUB_CACHE`` (``datasets--owner--name/refs/main`` and ``snapshots/<sha>/`` with the
  repository's README configs and Parquet shards).

``offline_home`` points the already imported libraries at a fresh ``HF_HOME`` in offline mode
(their path constants are read once at import, so setting the environment alone is not enough
in-process).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub.constants as hub_constants
import pytest
from datasets.packaged_modules.parquet.parquet import Parquet

SNAPSHOT_SHA = "0123456789abcdef0123456789abcdef01234567"


def offline_home(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``HF_HOME=home``, offline, for this process's ``datasets`` and ``huggingface_hub``."""
    for var, value in (("HF_HOME", home), ("HF_DATASETS_CACHE", home / "datasets"),
                       ("HF_HUB_CACHE", home / "hub"), ("HF_HUB_OFFLINE", "1"),
                       ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(var, str(value))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", home / "datasets" / "dl")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", home / "datasets" / "ex")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return home


def prepared_cache(home: Path, repo_id: str, config: str,
                   splits: dict[str, dict[str, list[Any]]], work: Path) -> Path:
    """The folder an online ``load_dataset(repo_id, config)`` would have prepared."""
    owner, name = repo_id.split("/")
    files = {}
    for split, columns in splits.items():
        files[split] = [str(work / f"{split}.parquet")]
        datasets.Dataset.from_dict(columns).to_parquet(files[split][0])
    out = home / "datasets" / f"{owner}___{name.lower()}" / config / "0.0.0" / "feedc0ffee"
    Parquet(dataset_name=name, config_name=config, data_files=files).download_and_prepare(
        output_dir=str(out))
    return out


def hub_snapshot(home: Path, repo_id: str, configs: dict[str, dict[str, dict[str, list[Any]]]],
                 ) -> Path:
    """The hub cache entry ``hf download`` makes: per config, per split, one Parquet shard
    ``<config>/<split>-00000-of-00001.parquet`` and the README ``configs`` that name them."""
    root = home / "hub" / f"datasets--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / SNAPSHOT_SHA
    card = ["---", "configs:"]
    for config, splits in configs.items():
        card += [f"- config_name: {config}", "  data_files:"]
        for split, columns in splits.items():
            shard = snap / config / f"{split}-00000-of-00001.parquet"
            shard.parent.mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_dict(columns).to_parquet(str(shard))
            card += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    (snap / "README.md").write_text("\n".join([*card, "---", f"# {repo_id}", ""]))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(SNAPSHOT_SHA)
    return snap


def subprocess_env(home: Path) -> dict[str, str]:
    """The environment a fresh process reads the same offline ``HF_HOME`` with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env
