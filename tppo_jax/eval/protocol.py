"""How an eval draws its answers: one spec for the run's held-out eval (during training),
``tppo eval RUN`` and ``tppo eval --benchmark``, with the choice of protocol explicit.

Every eval takes one greedy answer per question; the protocol says how the sampled answers
are drawn. Two named protocols:

- ``run``: what the run trains on: ``train.eval_samples`` answers at the rollout's sampling
  (``rollout.temperature`` / ``top_p`` / ``top_k``), at most ``L`` tokens, keyed by
  ``train.seed``. The in-run held-out eval uses it, so ``tppo eval RUN`` reproduces the
  held-out numbers in ``metrics.jsonl``.
- ``paper``: what math-RL papers report (DAPO's and VAPO's evaluation): 8 answers at
  temperature 1.0 and top-p 0.7, at most ``L`` tokens, seed 0. ``tppo eval --benchmark``'s
  default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the CLI imports PROTOCOLS: no jax at import time)
    from tppo_jax.config import Config
    from tppo_jax.rollout.decode import SamplingParams

PROTOCOLS: tuple[str, ...] = ("run", "paper")


@dataclass(frozen=True)
class EvalProtocol:
    """``samples`` answers per question (0: the greedy answer only) drawn at
    ``temperature`` (0: greedy) / ``top_p`` / ``top_k`` (0: off), each at most
    ``max_tokens`` long; ``seed`` keys the sampling, so a re-run draws the same answers."""

    name: str
    samples: int
    temperature: float
    top_p: float
    max_tokens: int
    top_k: int = 0
    seed: int = 0

    @property
    def sampling(self) -> SamplingParams:
        """The decode's sampling parameters for the sampled answers."""
        from tppo_jax.rollout.decode import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              greedy=self.temperature == 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def overridden(self, *, samples: int | None = None, temperature: float | None = None,
                   top_p: float | None = None, max_tokens: int | None = None,
                   seed: int | None = None) -> EvalProtocol:
        """This protocol with the given fields replaced (None keeps a field); the name says
        when anything changed (``paper+``), so a report never claims a protocol it did not
        follow."""
        given = {k: v for k, v in dict(samples=samples, temperature=temperature, top_p=top_p,
                                       max_tokens=max_tokens, seed=seed).items()
                 if v is not None}
        changed = {k: v for k, v in given.items() if getattr(self, k) != v}
        if not changed:
            return self
        return replace(self, **changed, name=self.name.rstrip("+") + "+")


def run_protocol(cfg: Config) -> EvalProtocol:
    """The ``run`` protocol of ``cfg`` (see the module docstring)."""
    r = cfg.rollout
    return EvalProtocol("run", samples=cfg.train.eval_samples, temperature=r.temperature,
                        top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_response_len,
                        seed=cfg.train.seed)


def paper_protocol(cfg: Config) -> EvalProtocol:
    """The ``paper`` protocol, with ``cfg``'s ``L`` as the answer length."""
    return EvalProtocol("paper", samples=8, temperature=1.0, top_p=0.7,
                        max_tokens=cfg.rollout.max_response_len)


def protocol_named(name: str, cfg: Config) -> EvalProtocol:
    """``run`` or ``paper`` for ``cfg``."""
    if name not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {name!r}")
    return run_protocol(cfg) if name == "run" else paper_protocol(cfg)
