"""Hugging Face Hub ids as model references: ``model.path: Qwen/Qwen2.5-0.5B-Instruct``.

``resolve_model`` turns what a user wrote into something the loaders open: a local path or a
URL (``gs://...``, ``pypi:...``) as is; a Hub id ``owner/name[@revision]`` (a folder: config,
tokenizer, safetensors) or ``owner/name[@revision]/FILE.gguf`` (one GGUF file) downloaded
with ``huggingface_hub.snapshot_download`` into the standard HF cache (``HF_HOME`` /
``HF_HUB_CACHE``), fetching only the files the loaders read. ``HF_HUB_OFFLINE=1`` reads the
cache alone, with no network. The config keeps the id as written (a run's ``config.yaml``
says ``owner/name``, not a cache path); a local folder of the same name wins over the Hub,
as in transformers. What cannot be had is one ``HubError`` line naming the id and why.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tppo_jax.config_checks import ConfigError

log = logging.getLogger(__name__)

__all__ = ["HUB_FILES", "HubError", "HubRef", "parse_hub_ref", "resolve_model"]

# What ``from_pretrained`` and ``Tokenizer.load`` read from an HF folder (weights, config,
# tokenizer, its special ids and chat template, the EOS ids); nothing else is downloaded.
HUB_FILES = ("config.json", "generation_config.json", "*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer.model",
             "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

_NAME = r"[A-Za-z0-9][\w.-]*"  # a Hub owner or repo name (no "/", not "." or "..")
_REF = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[^@\s]+?))?"
                  rf"(?:/(?P<file>[^/@\s]+\.gguf))?")
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubError(ConfigError):
    """A Hub id that cannot be resolved (not cached offline, not found, gated); one line."""


@dataclass(frozen=True)
class HubRef:
    repo: str  # owner/name
    revision: str | None  # branch, tag or commit; None = main
    file: str | None  # a .gguf file in the repo; None = the HF folder


def parse_hub_ref(ref: str) -> HubRef | None:
    """``owner/name[@rev][/FILE.gguf]`` as a ``HubRef``; None for anything else (a URL, an
    absolute or ``./`` path, ``pypi:...``)."""
    m = _REF.fullmatch(ref.strip())
    if m is None or ref.startswith((".", "~")):
        return None
    return HubRef(m["repo"], m["rev"], m["file"])


def resolve_model(ref: str, key: str = "model.path") -> str:
    """The local path the loaders open for ``ref`` (the value of config key ``key``, named in
    errors): ``ref`` itself when it is a URL, an existing path or no Hub id; else the Hub
    snapshot folder (or the ``.gguf`` file in it) in the HF cache, downloaded if missing."""
    if "://" in ref or Path(ref).expanduser().exists():
        return ref
    hub = parse_hub_ref(ref)
    if hub is None:
        return ref  # the loader names the missing path
    folder = Path(_snapshot(hub, ref, key))
    if hub.file is not None:
        if not (folder / hub.file).is_file():
            raise HubError(f"{key} {ref}: {hub.repo} has no file {hub.file}")
        return str(folder / hub.file)
    if not (folder / "config.json").is_file():
        raise HubError(f"{key} {ref}: no config.json in {hub.repo} (a GGUF-only repo? use "
                       f"model.source: gguf and name the file: {hub.repo}/FILE.gguf)")
    log.info("%s %s: %s", key, ref, folder)
    return str(folder)


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` as the environment says now (huggingface_hub reads it at import;
    a notebook may set it after)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or env.upper() in _TRUE


def _cache_dir() -> str | None:
    """``HF_HUB_CACHE``, else ``HF_HOME/hub``, as the environment says now; None =
    huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def _snapshot(hub: HubRef, ref: str, key: str) -> str:
    """``snapshot_download`` of the files ``hub`` needs; its failures as one ``HubError``."""
    from huggingface_hub import snapshot_download

    offline = _offline()
    try:
        return snapshot_download(hub.repo, revision=hub.revision, cache_dir=_cache_dir(),
                                 allow_patterns=[hub.file] if hub.file else list(HUB_FILES),
                                 local_files_only=offline)
    except Exception as e:
        raise HubError(f"{key} {ref}: {_why(e, hub, offline)}") from None


def _why(e: Exception, hub: HubRef, offline: bool) -> str:
    """Why a download failed, in words (huggingface_hub's own messages span lines)."""
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return (f"{hub.repo} is gated: accept its terms on https://huggingface.co/{hub.repo} "
                f"and log in (hf auth login, or HF_TOKEN)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"no such local path, and {hub.repo} is not on the Hugging Face Hub (or is "
                f"private: log in with hf auth login, or HF_TOKEN)")
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{hub.repo} has no revision {hub.revision}"
    if isinstance(e, errors.LocalEntryNotFoundError):  # IncompleteSnapshotError too
        from huggingface_hub import constants

        what = hub.repo + (f"@{hub.revision}" if hub.revision else "")
        how = ("HF_HUB_OFFLINE=1 forbids downloading it" if offline
               else "the Hub could not be reached")
        part = "only partly" if isinstance(e, errors.IncompleteSnapshotError) else "not"
        return (f"no such local path, and {what} is {part} in the Hugging Face cache "
                f"({_cache_dir() or constants.HF_HUB_CACHE}) and {how}")
    if isinstance(e, errors.HFValidationError):
        return f"not a valid Hugging Face Hub id ({hub.repo})"
    text = " ".join(str(e).split())[:200]
    return f"download of {hub.repo} failed ({type(e).__name__}: {text})"
