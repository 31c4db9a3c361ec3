#!/usr/bin/env bash
# Decode roofline fraction, train-step MFU (policy and value), XLA cost proxies and the
# transformers baseline of a 0.5B Qwen2-shaped random model at batch 256 on a GPU machine,
# in < 5 minutes; writes results/accelerator_gpu.json. Extra arguments go to
# `tppo bench accelerator` (e.g. --arch tiny for a smoke run, --remat dots).
#
# Offline-safe: it uses the jax already installed for the machine's python (PYTHON, default
# python3; never `pip install jax[...]`), in a venv with --system-site-packages
# (TPPO_ACCEL_VENV, default .venv-accel), and installs tppo-jax (not editable) with jax
# pinned to that version. When pip cannot reach an index (or TPPO_OFFLINE=1) it installs
# from the wheel folder TPPO_WHEELS (default ./wheels). Fill that folder on an online machine
# with the same OS, CPU architecture and Python version:
#
#   pip download -d wheels "setuptools>=61" wheel
#   pip wheel -w wheels .                  # the project and every dependency, as wheels
#
# (or `pip download -d wheels --only-binary=:all: --python-version 3.11
#  --platform manylinux2014_x86_64 <each dependency in pyproject.toml>` from another OS).
# The jax wheels in the folder are ignored: the machine's jax satisfies the pin.
# It runs from a temporary directory so the checkout never shadows the installed package.
#
# Any other benchmark runs the same way: TPPO_BENCH names it, TPPO_BENCH_TIMEOUT bounds it.
# T-PPO vs PPO on the long tail, one seed, where the decode is not the CPU's:
#
#   TPPO_BENCH=tppo-vs-ppo TPPO_BENCH_TIMEOUT=560 benchmarks/gpu.sh --config longtail \
#       --seeds 1 --target 100 --budget-s 120 --eval-every 0 --eval-every-s 20 --out "$OUT"
exec "$(dirname "$0")/accelerator.sh" "${TPPO_BACKEND:-gpu}" "$@"
