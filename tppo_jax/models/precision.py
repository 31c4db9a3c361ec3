"""Mixed precision: float32 master weights, computation in the model's dtype.

A bfloat16 model (``model.dtype: bfloat16``) trains on float32 *master* params
(``model.param_dtype: float32``, the default): the ``TrainState`` and the AdamW moments are
float32, each forward and backward pass runs on a bfloat16 copy cast from them inside the
jitted program (``compute``), and the gradient flows back through the cast to float32. An
AdamW step moves a weight by about the learning rate (1e-6 in the shipped TPU configs), far
below half a bfloat16 ulp of a typical weight (~5e-5 at |w| ~ 0.01): on bfloat16 params the
update rounds away. This is the policy of MaxText, levanter (jmp) and tunix: params fp32,
compute bf16, output fp32.

The critic's scalar head (``FLOAT32_PARAMS``) is float32 in every model dtype and is never
cast. A float32 model has nothing to cast: ``compute(params, None)`` is ``params`` itself.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Top-level params kept in float32 whatever the model's dtype (models/value.py's head).
FLOAT32_PARAMS = ("head", "head_bias")


def _cast(tree: Any, dtype: Any) -> Any:
    def leaf(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            if isinstance(x, jax.ShapeDtypeStruct):  # the compile path's abstract params
                return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
            return x.astype(dtype)
        return x
    return jax.tree.map(leaf, tree)


def cast_params(params: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """``params`` (a pure dict) with every float leaf in ``dtype`` except the top-level
    ``FLOAT32_PARAMS``; ``params`` itself when ``dtype`` is None. Abstract
    ``ShapeDtypeStruct`` leaves are cast alike (``jax.eval_shape``)."""
    if dtype is None:
        return params
    dt = jnp.dtype(dtype)
    if isinstance(params, dict):
        return {k: v if k in FLOAT32_PARAMS else _cast(v, dt) for k, v in params.items()}
    return _cast(params, dt)


def compute_dtype(model_dtype: str, param_dtype: str) -> str | None:
    """The dtype the forward casts the stored params to: ``model_dtype`` when the params are
    stored in another (float32 masters of a bfloat16 model), else None (no cast)."""
    return None if param_dtype == model_dtype else model_dtype

