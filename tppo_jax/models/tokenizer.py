"""One ``Tokenizer`` over sentencepiece ``.model`` files and HF ``tokenizer.json`` files.

An HF tokenizer folder also gives the chat template (rendered by ``data/prompts.py``), whether
encoding starts with BOS, and every id that ends a generation (``generation_config.json`` and
the template's end-of-turn token). Also ``train_sentencepiece`` for the tiny CPU default (a
128-piece BPE vocab trained on synthetic math text, digits split into single pieces so numbers
tokenize compositionally).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence

# End-of-turn tokens of common chat templates: one ends a generation when the template uses it.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>",
                   "<|end_of_text|>")


def _read_json(path: pathlib.Path) -> dict:
    if not path.exists():
        return {}
    try:
        out = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable JSON ({e})") from None
    return out if isinstance(out, dict) else {}


def read_chat_template(folder: pathlib.Path) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates: ``default`` wins)."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    t = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t if isinstance(t, str) and t.strip() else None


class Tokenizer:
    """Backend-agnostic tokenizer; build it with ``Tokenizer.load(path)``.

    Attributes:
      bos_id / eos_id / pad_id: special ids (``None`` when the vocab has no such token;
        ``pad_id`` falls back to ``eos_id`` so right padding always has a value).
      eos_ids: every id that ends a generation (``eos_id`` first; instruct models add their
        end-of-turn tokens). Decoding stops on any of them.
      add_bos: whether a prompt starts with ``bos_id`` (``add_bos_token`` of the tokenizer
        config); ``data/prompts.py`` adds it only when the rendered text does not already.
      chat_template: the jinja chat template (None: plain prompts), plus the ``bos_token`` /
        ``eos_token`` texts it is rendered with.
    """

    def __init__(self, backend: str, impl: object, bos_id: int | None, eos_id: int | None,
                 pad_id: int | None):
        self.backend = backend
        self._impl = impl
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.eos_ids: tuple[int, ...] = () if eos_id is None else (int(eos_id),)
        self.add_bos = False
        self.chat_template: str | None = None
        self.bos_token = self.eos_token = ""

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, path: str | pathlib.Path) -> Tokenizer:
        """From a sentencepiece ``.model``, a ``tokenizer.json``, or a directory with either."""
        p = pathlib.Path(path)
        if p.is_dir():
            for name in ("tokenizer.json", "tokenizer.model", "spm.model"):
                if (p / name).exists():
                    return cls.load(p / name)
            models = sorted(p.glob("*.model"))
            if not models:
                raise FileNotFoundError(f"{p}: no tokenizer.json or *.model file")
            return cls.load(models[0])
        if p.suffix == ".json":
            return cls._from_hf(p)
        return cls._from_sentencepiece(p)

    @classmethod
    def _from_sentencepiece(cls, path: pathlib.Path) -> Tokenizer:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(path))
        ids = [sp.bos_id(), sp.eos_id(), sp.pad_id()]
        bos, eos, pad = (None if i < 0 else i for i in ids)
        return cls("sentencepiece", sp, bos, eos, pad)

    @classmethod
    def _from_hf(cls, path: pathlib.Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(path))
        # Special tokens may be declared in a sibling tokenizer_config.json (HF layout; an
        # explicit null means "none", as Qwen's bos_token); otherwise guess from common names.
        cfg = _read_json(path.parent / "tokenizer_config.json")
        guesses = {"bos": ["<s>", "<bos>", "<|begin_of_text|>", "<|endoftext|>"],
                   "eos": ["</s>", "<eos>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>"],
                   "pad": ["<pad>", "<|pad|>"]}
        ids: dict[str, int | None] = {}
        for k, guess in guesses.items():
            v = cfg.get(f"{k}_token")
            name = v.get("content") if isinstance(v, dict) else v
            candidates = [name] if name else ([] if f"{k}_token" in cfg else guess)
            ids[k] = next((tok.token_to_id(c) for c in candidates
                           if tok.token_to_id(c) is not None), None)
        out = cls("hf", tok, ids["bos"], ids["eos"], ids["pad"])
        out.add_bos = bool(cfg.get("add_bos_token", False)) and out.bos_id is not None
        out.chat_template = read_chat_template(path.parent)
        out.bos_token = "" if out.bos_id is None else tok.id_to_token(out.bos_id)
        out.eos_token = "" if out.eos_id is None else tok.id_to_token(out.eos_id)
        out.eos_ids = out._collect_eos_ids(_read_json(path.parent / "generation_config.json"))
        return out

    def _collect_eos_ids(self, gen_cfg: dict) -> tuple[int, ...]:
        """``eos_id``, then ``generation_config.json``'s ``eos_token_id`` (int or list), then
        the chat template's end-of-turn token: every id that ends a generation, once each."""
        ids = [] if self.eos_id is None else [self.eos_id]
        gen = gen_cfg.get("eos_token_id")
        ids += [gen] if isinstance(gen, int) else [i for i in gen or [] if isinstance(i, int)]
        if self.chat_template:
            for name in CHAT_END_TOKENS:
                i = self._impl.token_to_id(name)
                if i is not None and name in self.chat_template:
                    ids.append(i)
        vocab = self.vocab_size
        return tuple(dict.fromkeys(int(i) for i in ids if 0 <= int(i) < vocab))

    # ------------------------------------------------------------------ interface
    @property
    def vocab_size(self) -> int:
        if self.backend == "sentencepiece":
            return self._impl.get_piece_size()
        return self._impl.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Text -> ids (no specials unless asked, so prompt templates control them)."""
        if self.backend == "sentencepiece":
            ids = list(self._impl.encode(text))
        else:
            ids = list(self._impl.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def encode_batch(self, texts: Sequence[str], **kw: bool) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Ids -> text; bos/eos/pad are dropped when ``skip_special``."""
        ids = [int(i) for i in ids]
        if skip_special:
            special = {self.bos_id, self.eos_id, self.pad_id, *self.eos_ids} - {None}
            ids = [i for i in ids if i not in special]
        if self.backend == "sentencepiece":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=skip_special)


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: str | pathlib.Path,
    vocab_size: int = 128,
    *,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    user_symbols: Sequence[str] = ("\\boxed",),
) -> Tokenizer:
    """Trains a small sentencepiece model on ``texts``; writes ``{model_prefix}.model``.

    Ids: pad=0, unk=1, bos=2, eos=3. Digits are split into single pieces; ``vocab_size`` is a
    soft limit (``hard_vocab_limit=False``) so small corpora with few merges still train.
    """
    import sentencepiece as spm

    prefix = pathlib.Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([t for t in texts if t.strip()]),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        split_digits=True,
        # Identity normalisation keeps newlines and repeated spaces, so decode(encode(x)) == x
        # for the prompt templates (the default NFKC rule maps "\n" to a space).
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        byte_fallback=False,
        hard_vocab_limit=False,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        user_defined_symbols=list(user_symbols),
        minloglevel=2,
    )
    return Tokenizer.load(f"{prefix}.model")
