#!/usr/bin/env bash
# benchmarks/gpu.sh for a TPU VM (jax with libtpu already installed): same steps, same
# environment variables; writes results/accelerator_tpu.json.
exec "$(dirname "$0")/accelerator.sh" "${TPPO_BACKEND:-tpu}" "$@"
