"""Advantage estimators (a registry, as tunix's) and the targets of one step.

An estimator maps one step's current windows to the policy's advantages; ``compute_targets``
picks the one ``algo.advantage_baseline`` names, then whitens and clips the advantages and
adds the critic's Monte-Carlo returns and the masks. A new estimator is one function::

    @register_estimator("my_baseline")
    def my_baseline(w: Window, batch: TrainBatch, a: AlgoConfig) -> jax.Array:  # [B, W]
        ...

and ``algo.advantage_baseline: my_baseline`` selects it (docs/architecture.md). A config can
also name one as ``package.module:function`` (``algo.advantage_baseline: my_pkg.est:my_baseline``,
the rule ``reward.fn`` follows: ``tppo_jax/plugins.py``); ``resolve_estimator`` imports it.

An estimator registered with ``needs_critic=False`` (``rloo``) makes the run critic-free: no
value model is built, trained, checkpointed or compiled, value pretraining is skipped, and the
estimator's window is a *finished* row's whole response (an unfinished window has nothing to
judge it but a critic, so its tokens wait until their row ends, and train then, once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tppo_jax import algo
from tppo_jax.config import AlgoConfig, ConfigError
from tppo_jax.config_checks import quote
from tppo_jax.learner.batch import Targets, TrainBatch
from tppo_jax.plugins import load_plugin

Array = jax.Array


class Window(NamedTuple):
    """One step's current windows, gathered to ``W = rollout.window`` columns per row.

    rewards, values, mask: ``[B, W]`` (token rewards, ``V(s_t)`` of the rollout-time critic,
    1.0 on the window's tokens); lam: ``[B]`` the policy's GAE lambda per row.
    """

    rewards: Array
    values: Array
    mask: Array
    lam: Array


Estimator = Callable[[Window, TrainBatch, AlgoConfig], Array]


@dataclass(frozen=True)
class EstimatorEntry:
    """A registered estimator: its function, whether it reads the critic's values
    (``needs_critic``; False: the run has no critic at all) and whether it judges a finished
    row by its same-step siblings (``groups``: the step reports ``group_baseline_frac``)."""

    fn: Estimator
    needs_critic: bool = True
    groups: bool = False


ESTIMATORS: dict[str, EstimatorEntry] = {}


def register_estimator(name: str, *, needs_critic: bool = True, groups: bool = False
                       ) -> Callable[[Estimator], Estimator]:
    """Registers ``fn(window, batch, algo) -> advantages [B, W]`` under ``name`` (the value
    of ``algo.advantage_baseline`` that selects it). ``needs_critic=False``: ``fn`` never reads
    ``window.values`` (zeros), and its window is each finished row's whole response.
    ``groups``: ``fn`` reads ``batch.group`` (a baseline from same-step siblings)."""
    def add(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = EstimatorEntry(fn, needs_critic, groups)
        return fn
    return add


def resolve_estimator(name: str) -> EstimatorEntry:
    """The estimator ``algo.advantage_baseline`` names: a registered name, or
    ``package.module:function``, imported here (``plugins.load_plugin``) and kept in
    ``ESTIMATORS`` under that path. A function registered with ``register_estimator`` keeps
    its flags; any other reads the critic. ``ConfigError`` in one line when it names none."""
    entry = ESTIMATORS.get(name)
    if entry is not None:
        return entry
    if ":" not in name:
        names = sorted(n for n in ESTIMATORS if ":" not in n)
        raise ConfigError(f"algo.advantage_baseline: {quote(name)} is not a registered estimator; "
                          f"one of {names}, or package.module:function")
    fn = load_plugin("algo.advantage_baseline", name)
    entry = next((e for e in ESTIMATORS.values() if e.fn is fn), None) or EstimatorEntry(fn)
    ESTIMATORS[name] = entry
    return entry


def needs_critic(a: AlgoConfig) -> bool:
    """Whether ``a.advantage_baseline``'s estimator reads a critic (``resolve_estimator``:
    ``ConfigError`` when it names none)."""
    return resolve_estimator(a.advantage_baseline).needs_critic


def reads_groups(a: AlgoConfig) -> bool:
    """Whether ``a.advantage_baseline``'s estimator judges rows by their same-step siblings
    (registered with ``groups=True``)."""
    entry = ESTIMATORS.get(a.advantage_baseline)
    return entry is not None and entry.groups


@register_estimator("critic")
def egae_estimator(w: Window, batch: TrainBatch, a: AlgoConfig) -> Array:
    """EGAE on the critic's values: GAE over the window, an unfinished window bootstrapped
    with ``V(s_l) := V(s_{l-1})`` (docs/algorithm.md section 2)."""
    return algo.egae(w.rewards, w.values, w.mask, batch.finished, gamma=a.gamma, lam=w.lam)


@register_estimator("group", groups=True)
def group_estimator(w: Window, batch: TrainBatch, a: AlgoConfig) -> Array:
    """A finished row with a finished sibling in this step: its reward minus the siblings'
    mean (leave-one-out, as RLOO/GRPO) on every window token; EGAE elsewhere (only the
    critic can judge a window that has not ended). Reads ``batch.group``."""
    base, has = algo.group_baseline(batch.reward, batch.group, batch.finished)
    adv = egae_estimator(w, batch, a)
    return jnp.where((batch.finished & has)[:, None],
                     (batch.reward - base)[:, None] * w.mask, adv)


@register_estimator("rloo", needs_critic=False, groups=True)
def rloo_estimator(w: Window, batch: TrainBatch, a: AlgoConfig) -> Array:
    """Critic-free (RLOO / GRPO without the std): a finished row's reward minus the mean of
    its prompt's other samples that finished in this step, on its whole response (``w``
    spans it); 0 on a row with no such sibling. Reads ``batch.group``."""
    base, has = algo.group_baseline(batch.reward, batch.group, batch.finished)
    return jnp.where((batch.finished & has)[:, None],
                     (batch.reward - base)[:, None] * w.mask, 0.0)


def _gather_window(x: Array, start: Array, width: int) -> Array:
    idx = jnp.clip(start[:, None] + jnp.arange(width)[None], 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx, axis=1)


def _scatter_window(xw: Array, start: Array, length: int) -> Array:
    b, w = xw.shape
    idx = start[:, None] + jnp.arange(w)[None]
    return jnp.zeros((b, length), xw.dtype).at[jnp.arange(b)[:, None], idx].set(xw, mode="drop")


def outcome_rewards(batch: TrainBatch) -> Array:
    """``[B, S]`` token rewards: a finished row's reward on its last token, 0 elsewhere."""
    b, s = batch.shape
    last = jnp.maximum(batch.window_start + batch.window_len - 1, 0)
    return jnp.zeros((b, s), jnp.float32).at[jnp.arange(b), last].set(
        jnp.where(batch.finished, batch.reward, 0.0))


def policy_lambda(batch: TrainBatch, a: AlgoConfig, window: int) -> Array:
    """``[B]`` the policy's GAE lambda: length-adaptive (VAPO) on the effective response
    length, or ``algo.lam_policy``."""
    if not a.length_adaptive:
        return jnp.full(batch.finished.shape, a.lam_policy, jnp.float32)
    resp_len = batch.window_start + batch.window_len - batch.prompt_len
    return algo.length_adaptive_lambda(algo.effective_length(resp_len, batch.finished,
                                                             window=window),
                                       alpha=a.alpha, lam_min=a.lam_min)


def compute_targets(values: Array, batch: TrainBatch, a: AlgoConfig, window: int) -> Targets:
    """The policy's advantages on the current window (the registered estimator
    ``algo.advantage_baseline``), whitened and clipped on the policy mask; the critic's
    returns (MC, ``lam_critic = 1``) on every response token of finished rows; the masks.

    Args:
      values: ``[B, S]`` ``V(s_t)`` from the critic at rollout time.
      batch: the rollout.
      window: ``W``, the widest window (``rollout.window``, at most L).
    """
    b, s = batch.shape
    start, wlen, fin = batch.window_start, batch.window_len, batch.finished
    total = start + wlen
    rewards = outcome_rewards(batch)
    lam = policy_lambda(batch, a, window)
    entry = resolve_estimator(a.advantage_baseline)
    if entry.needs_critic:
        pmask = algo.policy_mask(s, start, wlen, fin, ignore_last=a.window_ignore_tokens)
    else:  # the window: a finished row's whole response
        start, window = batch.prompt_len, s
        wlen = jnp.where(fin, total - start, 0)
        pmask = algo.window_mask(s, start, wlen)
    mask_w = (jnp.arange(window)[None] < wlen[:, None]).astype(jnp.float32)
    w = Window(_gather_window(rewards, start, window), _gather_window(values, start, window),
               mask_w, lam)
    adv = _scatter_window(entry.fn(w, batch, a), start, s)
    if a.whiten_advantages:
        adv = algo.masked_whiten(adv, pmask, shift_mean=a.whiten_center)
    if a.advantage_clip is not None:
        adv = algo.masked_clip(adv, pmask, bound=a.advantage_clip)
    adv = adv * pmask

    rmask = algo.response_mask(s, batch.prompt_len, total)
    if a.lam_critic == 1.0:
        returns = algo.mc_returns(rewards, rmask, gamma=a.gamma)
    else:  # decoupled-GAE ablation: lambda-returns A + V with lam_critic
        returns = algo.gae(rewards, values, rmask, gamma=a.gamma, lam=a.lam_critic) + values
    return Targets(
        advantages=adv, policy_mask=pmask, returns=returns * rmask,
        value_mask=algo.value_mask(s, batch.prompt_len, total, fin),
        positive_mask=algo.positive_example_mask(s, batch.prompt_len, total, fin,
                                                 batch.correct.astype(bool)),
        values_old=values, lam=lam)
