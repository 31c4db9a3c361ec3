#!/usr/bin/env bash
# Per-worker wrapper that `tppo launch` runs over `gcloud compute tpus tpu-vm ssh --worker=all`.
#
#   launch/run_on_pod.sh ./install.sh
#       README install (./install.sh) with a Python >= 3.11 (TPU images ship 3.10), then the
#       TPU runtime for the installed jax (`jax[tpu]`, i.e. libtpu) when the VM has TPU chips.
#   launch/run_on_pod.sh .venv/bin/tppo train --config FILE --run-dir DIR [--resume] [key=value ...]
#       install (a no-op after the first time), then `.venv/bin/tppo train ...` with:
#       - model.path / model.value_path on gs:// copied once to local disk ($TPPO_MODELS_DIR)
#         and passed as overrides (the loaders read local folders);
#       - a gs:// run dir passed through: Orbax writes the checkpoints there (every host its
#         own shards) and process 0 mirrors the logs at each checkpoint (pulled back first
#         with --resume); worker 0's log is copied there at the end;
#       - its pid in ~/tppo-train.pid and exit status in ~/tppo-train.rc (the launcher's
#         log-streaming step waits on them).
#
# Multi-host: every worker runs the same command (`tppo launch` adds --distributed auto); JAX
# on Cloud TPU discovers the slice itself (no coordinator address or process id needed).
set -euo pipefail
cd "$(dirname "$0")/.."
STATE_DIR="${TPPO_STATE_DIR:-$HOME}"
MODELS_DIR="${TPPO_MODELS_DIR:-$HOME/models}"

log() { echo "[run_on_pod $(hostname)] $*" >&2; }

worker_id() {
  curl -sf --max-time 5 -H Metadata-Flavor:Google \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number \
    2>/dev/null || echo "${TPU_WORKER_ID:-0}"
}

pick_python() {
  local p
  for p in python3.13 python3.12 python3.11 python3; do
    if command -v "$p" >/dev/null 2>&1 &&
       "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$p"; return
    fi
  done
  log "no Python >= 3.11; installing python3.11 with apt"
  sudo apt-get update -qq >&2
  sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11 python3.11-venv >&2
  echo python3.11
}

install() {
  PYTHON="$(pick_python)" ./install.sh
  # Orbax writes gs:// paths through etils.epath, whose bucket backend is gcsfs.
  if ! .venv/bin/python -c 'import gcsfs' 2>/dev/null; then
    log "installing gcsfs (gs:// checkpoints)"
    .venv/bin/python -m pip install -q gcsfs
  fi
  # pyproject depends on plain jax (the CPU default); a TPU VM also needs libtpu.
  if compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
    if ! .venv/bin/python -c 'import libtpu' 2>/dev/null; then
      local v
      v="$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
      log "installing jax[tpu]==$v"
      .venv/bin/python -m pip install -q "jax[tpu]==$v"
    fi
  fi
}

stage_model() {  # gs://.../NAME -> $MODELS_DIR/NAME (once)
  local src="$1" dst="$MODELS_DIR/$(basename "$1")"
  if [[ ! -f "$dst/config.json" ]]; then
    log "copying $src to $dst"
    mkdir -p "$MODELS_DIR"
    gcloud storage cp -r "$src" "$MODELS_DIR/" >&2
  fi
  echo "$dst"
}

train() {
  echo $$ > "$STATE_DIR/tppo-train.pid"
  trap 'echo $? > "$STATE_DIR/tppo-train.rc"' EXIT
  install
  local config="" run_dir="runs/default" args=() overrides=()
  while (($#)); do
    case "$1" in
      --config) config="$2"; args+=("$1" "$2"); shift 2 ;;
      --run-dir) run_dir="$2"; shift 2 ;;
      --resume) args+=("$1"); shift ;;
      --*) args+=("$1"); shift ;;
      *) overrides+=("$1"); shift ;;
    esac
  done
  local paths model_path value_path
  paths="$(.venv/bin/python -c '
import sys
from tppo_jax.config import load_config
c = load_config(sys.argv[1] or None, sys.argv[2:])
print(c.model.path or "-", c.model.value_path or "-")' "$config" ${overrides[@]+"${overrides[@]}"})"
  read -r model_path value_path <<< "$paths"
  if [[ "$model_path" == gs://* ]]; then
    overrides+=("model.path=$(stage_model "$model_path")")
  fi
  if [[ "$value_path" == gs://* ]]; then
    overrides+=("model.value_path=$(stage_model "$value_path")")
  fi

  # A gs:// run dir goes to tppo train as is: Orbax writes the checkpoints there (every
  # host its own shards) and process 0 mirrors the logs there (tppo_jax/runs/run_dir.py).
  local worker
  worker="$(worker_id)"
  local cmd=(.venv/bin/tppo train --run-dir "$run_dir" ${args[@]+"${args[@]}"}
             ${overrides[@]+"${overrides[@]}"})
  log "worker $worker: ${cmd[*]}"
  local rc=0
  "${cmd[@]}" || rc=$?
  if [[ "$worker" == 0 && "$run_dir" == gs://* ]]; then
    gcloud storage cp "$STATE_DIR/tppo-train.log" "$run_dir/worker0.log" >&2 || true
  fi
  log "tppo train exited with $rc"
  return "$rc"
}

case "${1:-}" in
  ./install.sh|install) install ;;
  .venv/bin/tppo|tppo)
    [[ "${2:-}" == train ]] || { echo "usage: $0 .venv/bin/tppo train ARGS" >&2; exit 2; }
    shift 2; train "$@" ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
