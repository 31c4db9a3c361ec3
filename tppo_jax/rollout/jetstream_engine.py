"""``JetStreamEngine``: JetStream's ``Engine`` API over a ``rollout.engine.DecodeEngine``.

``tppo serve`` runs JetStream's orchestrator (``rollout.server``), which drives an engine
through ``prefill`` / ``insert`` / ``generate``. This adapter implements that interface by
delegation to the decode engine that training and the held-out eval use (no decode loop of
its own), so what is served is what trains. ``generate`` is the core's one-token step,
returned as ``TPPOResultTokens``: JetStream's token / valid / length columns plus each
token's log-prob and policy version.

JetStream (and the compatibility patches it needs, ``tppo_jax.compat.jetstream``) is
imported only here and in the server, never by the training path.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

# isort: split
from jetstream.engine import engine_api, tokenizer_pb2

from tppo_jax.rollout.engine import (
    STEP_COLUMNS,
    DecodeEngine,
    DecodeState,
    EngineParams,
    PoolExhaustedError,
    Prefix,
)
from tppo_jax.rollout.tokenizer_adapter import JetStreamTokenizer

log = logging.getLogger(__name__)

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def _columns(name: str) -> tuple[int, int]:
    i = STEP_COLUMNS.index(name)
    return i, i + 1


@struct.dataclass
class TPPOResultTokens(engine_api.ResultTokens):
    """JetStream ``ResultTokens`` (``data [S, 5 + 2N]`` int32: token, valid, length, log-prob
    bits, policy version, then N top ids and N top log-prob bits when the engine samples per
    row) with extra column ranges; the orchestrator reads only the first three."""

    logprob_idx: tuple[int, int] = struct.field(pytree_node=False,
                                                default=_columns("logprob_bits"))
    version_idx: tuple[int, int] = struct.field(pytree_node=False, default=_columns("version"))

    def convert_to_numpy(self) -> TPPOResultTokens:
        return self.replace(data=np.asarray(self.data))

    def logprobs(self) -> np.ndarray:
        """``[S, 1]`` float32 log-prob of each slot's token (junk where not valid)."""
        col = np.asarray(self.data[:, self.logprob_idx[0]:self.logprob_idx[1]], np.int32)
        return col.view(np.float32)

    def versions(self) -> np.ndarray:
        """``[S, 1]`` int32 policy version that sampled each token."""
        return np.asarray(self.data[:, self.version_idx[0]:self.version_idx[1]])

    def top(self) -> tuple[np.ndarray, np.ndarray]:
        """``([S, N] int32 ids, [S, N] float32 log-probs)``: each slot's N most likely
        tokens at this step (N = 0 unless the engine samples per row with top_logprobs)."""
        extra = np.asarray(self.data[:, len(STEP_COLUMNS):], np.int32)
        n = extra.shape[1] // 2
        return extra[:, :n], extra[:, n:].view(np.float32)


@struct.dataclass
class ServedPrefix:
    """A ``Prefix`` with how its request samples (``insert`` puts both into the slot):
    temperature (0 = greedy) / top_p (None: the engine's) and seq_id (its sampling stream;
    None: a fresh one)."""

    prefix: Prefix
    temperature: float | None = struct.field(pytree_node=False, default=None)
    top_p: float | None = struct.field(pytree_node=False, default=None)
    seq_id: int | None = struct.field(pytree_node=False, default=None)


class JetStreamEngine(engine_api.Engine):
    """JetStream's ``Engine`` over ``core`` (its slots, cache, sampling and stop tokens).

    Args:
      core: the ``DecodeEngine`` that decodes.
      tokenizer: ``models.tokenizer.Tokenizer`` (``build_tokenizer`` wraps it);
        tokenizer_path: reported to JetStream.
      max_prefill_length: JetStream's prefill bucket cap (16, 32, ... 32768), at most the
        core's ``max_target_length``.
      strict_insert: ``insert`` raises ``PoolExhaustedError`` when pages run out; False (the
        server) logs and leaves the slot empty, so JetStream ends that request with no tokens.
    """

    def __init__(self, core: DecodeEngine, tokenizer: Any, *, max_prefill_length: int = 128,
                 tokenizer_path: str = "", strict_insert: bool = True) -> None:
        if max_prefill_length not in PREFILL_BUCKETS:
            raise ValueError(f"max_prefill_length must be one of {PREFILL_BUCKETS}")
        if max_prefill_length > core.max_target_length:
            raise ValueError("max_prefill_length must not exceed max_target_length")
        self.core = core
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.strict_insert = strict_insert
        self._prefill_len = max_prefill_length

    # ------------------------------------------------------------------ Engine properties
    @property
    def max_concurrent_decodes(self) -> int:
        return self.core.max_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._prefill_len

    @property
    def mesh(self) -> Mesh:
        return self.core.mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    def get_prefix_destination_sharding(self) -> NamedSharding:
        return NamedSharding(self.core.mesh, PartitionSpec())

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> Any:
        """A ``JetStreamTokenizer`` over our tokenizer, stopping on the core's ``eos_ids``."""
        return JetStreamTokenizer(self.tokenizer, self.core.eos_ids)

    # ------------------------------------------------------------------ params / state
    def load_params(self, *args: Any, **kwargs: Any) -> EngineParams:
        """``DecodeEngine.load_params``: a module, an ``nnx.State`` or None (the core's
        initial model), and ``version=``."""
        return self.core.load_params(*args, **kwargs)

    def init_decode_state(self, *args: Any, **kwargs: Any) -> DecodeState:
        return self.core.init_decode_state()

    # ------------------------------------------------------------------ the requests
    def prefill(self, *, params: EngineParams, existing_prefix: Prefix | None = None,
                padded_tokens: Any, true_length: int) -> Prefix:
        """Caches ``padded_tokens[:true_length - 1]`` (``[P]``, P a prefill bucket)."""
        if existing_prefix is not None:
            raise NotImplementedError("JetStreamEngine does not extend existing prefixes")
        return self.core.prefill(params, padded_tokens, true_length)

    def insert(self, prefix: Prefix | ServedPrefix, decode_state: DecodeState, slot: int, *,
               seq_id: int | None = None) -> DecodeState:
        """Places a prefix into ``slot`` (freeing what it held), a ``ServedPrefix`` with its
        request's sampling; see ``strict_insert``. ``decode_state`` is donated."""
        sampling: dict[str, Any] = {}
        if isinstance(prefix, ServedPrefix):
            sampling = dict(temperature=prefix.temperature, top_p=prefix.top_p)
            seq_id = prefix.seq_id if seq_id is None else seq_id
            prefix = prefix.prefix
        try:
            return self.core.insert(prefix, decode_state, slot, seq_id=seq_id, **sampling)
        except PoolExhaustedError as e:
            if self.strict_insert:
                raise
            log.warning("%s; request dropped", e)
            return e.decode_state

    def generate(self, params: EngineParams, decode_state: DecodeState
                 ) -> tuple[DecodeState, TPPOResultTokens]:
        """One token for every live slot (``DecodeEngine.generate_step``).
        ``decode_state`` is donated (do not reuse it)."""
        ds, data = self.core.generate_step(params, decode_state)
        return ds, TPPOResultTokens(data=data, tokens_idx=_columns("token"),
                                    valid_idx=_columns("valid"), length_idx=_columns("length"),
                                    samples_per_slot=1)
