#!/usr/bin/env bash
# Decode roofline fraction + train-step MFU of a ~0.5B Qwen2-shaped random model at batch 256
# on a GPU or TPU machine (fits in 5 minutes). Installs jax for the accelerator on top of the
# README install, then runs `tppo bench accelerator`; results land in results/accelerator_*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
./install.sh
if command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "jax[cuda12]==$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
elif [[ -e /dev/accel0 || -n "${TPU_NAME:-}" ]]; then
  .venv/bin/python -m pip install -q "jax[tpu]==$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
fi
timeout 290 .venv/bin/tppo bench accelerator --arch qwen2-0.5b --batch 256 "$@"
