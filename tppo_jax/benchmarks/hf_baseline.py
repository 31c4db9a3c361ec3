"""``transformers.generate`` baseline for ``benchmarks/accelerator.py``: the same random
Qwen2 shape, greedy, ``new_tokens`` forced (no early EOS), static and dynamic KV cache.

Runs only where torch and transformers import (on the GPU when torch sees one); otherwise
``run`` returns ``{"skipped": reason}``. No weights are downloaded: the model is built from a
``Qwen2Config`` with random initialisation.
"""

from __future__ import annotations

import time


def available() -> str | None:
    """None when torch and transformers import, else why not."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA build raising at import
        return f"torch/transformers not importable ({type(e).__name__}: {e})"
    return None


def _model(arch: str, dtype: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tppo_jax.benchmarks.intensity import ARCHS

    a = ARCHS[arch]
    cfg = Qwen2Config(vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                      intermediate_size=a.intermediate_size, num_hidden_layers=a.num_layers,
                      num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                      tie_word_embeddings=a.tie_embeddings, eos_token_id=None,
                      pad_token_id=0, max_position_embeddings=4096)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=torch_dtype).eval(), device


def run(arch: str, batch: int, prompt_len: int, new_tokens: int, dtype: str) -> dict:
    """Tokens/s of greedy ``generate`` with ``cache_implementation`` static and dynamic."""
    why = available()
    if why:
        return {"skipped": why}
    import torch

    model, device = _model(arch, dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (batch, prompt_len), generator=gen)
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "torch": torch.__version__, "batch": batch, "new_tokens": new_tokens}

    def once(impl: str | None) -> float:
        kw = {"cache_implementation": impl} if impl else {}
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            res = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        assert res.shape[1] == prompt_len + new_tokens, res.shape
        return time.perf_counter() - t0

    for name, impl in (("static", "static"), ("dynamic", None)):
        once(impl)  # warm-up: allocations, kernels
        dt = once(impl)
        out[name] = {"seconds": dt, "tokens_per_s": batch * new_tokens / dt}
    return out
