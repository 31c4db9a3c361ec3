#!/usr/bin/env bash
# Shared body of benchmarks/gpu.sh and benchmarks/tpu.sh: BACKEND (gpu|tpu|cpu) then the
# arguments of `tppo bench accelerator`, or of `tppo bench $TPPO_BENCH` when that is set
# (e.g. TPPO_BENCH=tppo-vs-ppo). See gpu.sh for the environment it expects.
set -euo pipefail
want="$1"; shift
# The checkout's root: the first folder above this script that holds pyproject.toml (the
# script is tppo_jax/benchmarks/accelerator.sh, also reached through the benchmarks/ link).
repo="$(cd "$(dirname "$0")" && while [[ ! -f pyproject.toml && "$PWD" != / ]]; do cd ..; done; pwd)"
py="${PYTHON:-python3}"
venv="${TPPO_ACCEL_VENV:-$repo/.venv-accel}"
wheels="${TPPO_WHEELS:-$repo/wheels}"
log() { echo "[accelerator] $*" >&2; }
die() { log "$*"; exit 1; }

# Never run from inside the source tree: its tppo_jax/ would shadow the installed package.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"

# 1. The machine's own jax, with its accelerator plugin: used as is, never installed here.
"$py" -c "import jax" 2>/dev/null ||
  die "$py cannot import jax: install the jax build for this machine (or set PYTHON)"
if [[ ! -x "$venv/bin/python" ]]; then
  "$py" -m venv --system-site-packages "$venv"
  # When $py is itself a venv/conda python, --system-site-packages alone would not see its
  # packages: list its site directories too (after the new venv's own).
  "$py" -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")/machine.pth"
fi
vpy="$venv/bin/python"
backend="$("$vpy" -c "import jax; print(jax.default_backend())")"
[[ "$backend" == "$want" ]] ||
  die "jax in $venv reports backend '$backend', not '$want' (is its plugin installed?)"

# 2. The project and its pure-Python dependencies, jax pinned to the machine's version.
"$vpy" -c "from importlib.metadata import version as v
for p in ('jax', 'jaxlib'): print(f'{p}=={v(p)}')" > "$work/constraints.txt"
install() { "$vpy" -m pip install -q --disable-pip-version-check -c "$work/constraints.txt" "$@"; }
if [[ "${TPPO_OFFLINE:-0}" != 1 ]] && install --timeout 10 --retries 0 "$repo" 2> "$work/pip.log"
then
  log "installed tppo-jax from $repo (dependencies from the package index)"
elif [[ -d "$wheels" ]]; then
  log "no package index; installing from $wheels"
  install --no-index --find-links "$wheels" "setuptools>=61" wheel ||
    die "$wheels lacks setuptools or wheel (see gpu.sh for how to fill it)"
  install --no-index --find-links "$wheels" --no-build-isolation "$repo" ||
    die "offline install from $wheels failed (see gpu.sh for how to fill it)"
else
  cat "$work/pip.log" >&2 || true
  die "pip could not install and $wheels does not exist (see gpu.sh for building it)"
fi
"$vpy" - "$repo" <<'PY' || die "tppo_jax still resolves inside the source tree"
import sys
import tppo_jax.benchmarks.accelerator as m
assert not m.__file__.startswith(sys.argv[1] + "/"), m.__file__
PY

# 3. The benchmark (accelerator: < 5 minutes with compile); results land in <repo>/results
# unless --out (the last --out given wins).
timeout "${TPPO_BENCH_TIMEOUT:-270}" "$vpy" -m tppo_jax.cli bench "${TPPO_BENCH:-accelerator}" \
  --out "$repo/results" "$@"
