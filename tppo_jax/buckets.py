"""Column-width buckets: the few static widths a jitted batch over a token buffer may have.

Every distinct input shape of a jitted function is one XLA compile, so a batch cut to its
longest row is rounded up to one of these. The rollout's prefill and the updates share them.
"""

from __future__ import annotations


def width_buckets(cap: int, base: int = 32) -> list[int]:
    """The column widths a batch may have: ``base * 2^k`` below ``cap``, then ``cap``.

    Powers of two keep the count logarithmic in ``cap`` (6 for a 576-token buffer, against 18
    multiples of 32); a batch pays at most twice its width, cheaper than a compile per
    width on CPU where one compile of the three update functions costs tens of steps."""
    out, w = [], base
    while w < cap:
        out.append(w)
        w *= 2
    return [*out, cap]


def bucket_width(n: int, cap: int, base: int = 32) -> int:
    """The smallest width bucket holding ``n`` columns (``cap`` at most)."""
    return next(w for w in width_buckets(cap, base) if w >= min(n, cap))
