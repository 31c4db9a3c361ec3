"""The policy a command serves or evaluates, from what the user named: a run directory (its
checkpoint), a Hugging Face folder (config.json + safetensors, the tokenizer in it or in its
parent, as ``tppo export`` writes one), or a Hub model id ``owner/name[@revision]``
(fetched into, or read from, the HF cache by ``models.hub.resolve_model``).

One place for ``tppo serve --checkpoint`` and ``tppo eval --benchmark``, so both read a
name the same way and fail on it with the same one line. A run directory's policy is
``restore.policy_from_run``'s."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tppo_jax.config_checks import ConfigError
from tppo_jax.weights.restore import LoadedPolicy, is_run_dir, policy_from_run

if TYPE_CHECKING:
    from tppo_jax.models.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def resolve_policy_path(ref: str, flag: str) -> Path:
    """The local folder ``ref`` names: an existing directory as is, a Hub id resolved to its
    snapshot in the HF cache (downloaded if missing). Anything else is one ``ConfigError``
    line naming ``flag``, raised before a model is loaded or compiled."""
    if Path(ref).is_dir():
        return Path(ref)
    from tppo_jax.models.hub import parse_hub_ref, resolve_model

    hub = parse_hub_ref(ref)
    if hub is None:
        raise ConfigError(f"{flag} {ref}: not a directory (nor a Hub id owner/name)")
    if hub.file is not None:
        raise ConfigError(f"{flag} {ref}: a GGUF file; convert it first (tppo convert) and "
                          f"pass the folder")
    return Path(resolve_model(ref, flag))


def load_hf_folder(folder: Path, dtype: str) -> tuple[Any, Tokenizer, Path]:
    """``(model, tokenizer, tokenizer file)`` of an HF folder; the tokenizer may sit in the
    folder or in its parent (a run's ``policy/`` export beside its ``tokenizer.model``).
    ``FileNotFoundError`` when neither has one."""
    from tppo_jax.models.hf import from_pretrained
    from tppo_jax.models.tokenizer import Tokenizer

    tok_dir = next((d for d in (folder, folder.parent)
                    if any((d / n).exists() for n in TOKENIZER_FILES)), None)
    if tok_dir is None:
        raise FileNotFoundError(f"no tokenizer.json / tokenizer.model in {folder} or its parent")
    tok_file = next(tok_dir / n for n in reversed(TOKENIZER_FILES) if (tok_dir / n).exists())
    return from_pretrained(folder, dtype=dtype), Tokenizer.load(tok_dir), tok_file


def policy_from_name(ref: str, *, dtype: str, step: int | None = None,
                     flag: str = "--checkpoint") -> LoadedPolicy:
    """The policy ``ref`` names (see the module docstring); ``step``: a run's checkpoint
    (default: its newest good one), refused for an HF folder. Unreadable model files are
    one ``ConfigError`` line."""
    path = resolve_policy_path(ref, flag)
    if is_run_dir(path):
        return policy_from_run(path, step, ref=ref)
    if step is not None:
        raise ConfigError(f"--step {step}: {ref} is an HF folder, not a run directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag} {ref}: neither a run directory (config.yaml) nor an HF "
                          f"folder (config.json)")
    try:
        model, tok, tok_file = load_hf_folder(path, dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {ref}: cannot load the model: {e}") from None
    return LoadedPolicy(model, tok, tok_file, str(path), ref)
