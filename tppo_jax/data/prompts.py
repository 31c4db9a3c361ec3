"""The one owner of prompt construction: a data row -> the text and token ids a policy sees.

Three layers, each overridable from config (``data.*``):

1. the user message: the question under a per-format default (math formats append the
   standard ``Please reason step by step, and put your final answer within \\boxed{}.``;
   DAPO-Math-17K rows already carry their own complete prompt, which asks for a final
   ``Answer: ...`` line, so they are used as given), or ``data.prompt_template`` (any text
   with a ``{question}`` placeholder);
2. the tokenizer's chat template (``tokenizer_config.json`` / ``chat_template.jinja``),
   rendered with jinja2 the way transformers' ``apply_chat_template`` does, with an optional
   ``data.system_prompt`` and the assistant generation prompt at the end; a tokenizer without
   a template (or ``data.chat_template: false``) gets the plain message and a ``Solution:`` cue;
3. the tiny CPU model keeps the short ``Q: ...\\nA: `` template it was warm-started on.

Token ids: the rendered text is encoded without special tokens; BOS is prepended only when
the tokenizer asks for it (``add_bos_token``) and the template did not already render it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tppo_jax.data.readers import MathExample

if TYPE_CHECKING:
    from tppo_jax.config import Config
    from tppo_jax.models.tokenizer import Tokenizer

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SHORT_ANSWER_CUE = "\nA: "  # where the tiny model's answer starts (warm-start loss mask)
SHORT_TEMPLATE = "Q: {question}" + SHORT_ANSWER_CUE  # the tiny model's warm-start format
# Formats whose rows hold their own full prompt text (and answer instruction).
OWN_PROMPT_FORMATS = ("dapo",)
PLAIN_CUE = "\nSolution:"  # after the message when there is no chat template


def default_template(data_format: str) -> str:
    """The user message for rows of ``data_format`` (``{question}`` is the row's text)."""
    if data_format in OWN_PROMPT_FORMATS:
        return "{question}"
    return "{question}\n\n" + BOXED_INSTRUCTION


def short_prompt(question: str) -> str:
    """The tiny model's prompt (also its warm-start corpus prefix)."""
    return SHORT_TEMPLATE.replace("{question}", question)


# ----------------------------------------------------------------------------- chat templates
def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    # The same environment transformers builds: sandboxed, trim/lstrip blocks, loop controls,
    # and its helpers (raise_exception, strftime_now, a tojson that keeps non-ASCII text).
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, str]], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True) -> str:
    """``messages`` rendered by a jinja chat template, as ``apply_chat_template(...,
    tokenize=False)`` would."""
    return _compile(template).render(messages=messages, bos_token=bos_token,
                                     eos_token=eos_token,
                                     add_generation_prompt=add_generation_prompt)


def chat_text(messages: list[dict[str, str]], tok: Tokenizer | None) -> str:
    """A conversation as the prompt text a model answers: ``tok``'s chat template with the
    assistant generation prompt when it has one; otherwise (the documented plain fallback)
    the turns' contents joined by blank lines, then the ``Solution:`` cue that plain math
    prompts end with."""
    template = getattr(tok, "chat_template", None)
    if template:
        return render_chat(template, messages, bos_token=getattr(tok, "bos_token", "") or "",
                           eos_token=getattr(tok, "eos_token", "") or "")
    return "\n\n".join(m["content"] for m in messages) + PLAIN_CUE


# ----------------------------------------------------------------------------------- builder
@dataclass(frozen=True)
class PromptBuilder:
    """Turns rows into prompt text / ids. Build it with :func:`prompt_builder`.

    Attributes:
      template: the user message, ``{question}`` replaced by the row's question.
      system_prompt: a system turn before it (chat templates only; prepended otherwise).
      chat_template: jinja source, or None for plain text.
      short: the tiny model's ``Q: ...\\nA: `` format (template and chat ignored).
    """

    template: str = "{question}\n\n" + BOXED_INSTRUCTION
    system_prompt: str | None = None
    chat_template: str | None = None
    short: bool = False
    bos_token: str = ""
    eos_token: str = ""

    def messages(self, example: MathExample | str) -> list[dict[str, str]]:
        q = (example.question if isinstance(example, MathExample) else example).strip()
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        # str.replace, not str.format: instructions contain LaTeX braces (\boxed{}).
        return out + [{"role": "user", "content": self.template.replace("{question}", q)}]

    def text(self, example: MathExample | str) -> str:
        """The full prompt text, ending where the model's answer starts."""
        if self.short:
            q = example.question if isinstance(example, MathExample) else example
            return short_prompt(q)
        msgs = self.messages(example)
        if self.chat_template is not None:
            return render_chat(self.chat_template, msgs, bos_token=self.bos_token,
                               eos_token=self.eos_token)
        return chat_text(msgs, None)

    def ids(self, example: MathExample | str, tok: Tokenizer) -> list[int]:
        """Token ids of :meth:`text`; BOS once at most (see the module docstring)."""
        ids = tok.encode(self.text(example))
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids = [tok.bos_id] + ids
        return ids


def prompt_builder(cfg: Config, tok: Tokenizer | None = None) -> PromptBuilder:
    """The prompt format ``cfg`` asks for, with ``tok``'s chat template (when it has one
    and ``data.chat_template`` is on). ``tok`` may be None where no template is needed."""
    d = cfg.data
    if cfg.model.source == "tiny":
        return PromptBuilder(short=True)
    template = d.prompt_template or default_template(d.format)
    chat = tok.chat_template if tok is not None and d.chat_template else None
    return PromptBuilder(template=template, system_prompt=d.system_prompt or None,
                         chat_template=chat, bos_token=getattr(tok, "bos_token", "") or "",
                         eos_token=getattr(tok, "eos_token", "") or "")
