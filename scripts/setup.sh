#!/usr/bin/env bash
# Installs what Strata needs to build and test: a Python virtual environment holding
# PyPI's torch==2.11.0 (which carries libtorch for tch 0.24), shared by every clone on
# the machine, plus two links in the checkout:
#   .venv      -> the shared environment (used by the PyTorch reference scripts)
#   .libtorch  -> its torch package folder (LIBTORCH for the build, see .cargo/config.toml)
# Idempotent: a second run, or a second clone, reuses the environment and downloads nothing.
set -euo pipefail

TORCH_VERSION=2.11.0
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${STRATA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}
python=${PYTHON:-python3}
pyver=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv="$cache/venv-torch-$TORCH_VERSION-py$pyver"

# Python packages of the environment: libtorch itself, what the PyTorch reference scripts use
# (transformers: the reference for model folders and generation; peft: for LoRA adapters;
# trl: the reference for preference optimisation; tensorboard: the reader of event files), and the CUDA headers torch's wheel leaves out (headers only: with them
# strata-ext's build compiles the CUDA code paths, so one build serves a GPU machine and a CPU one).
packages=("torch==$TORCH_VERSION" "numpy" "safetensors" "transformers==5.23.0" "peft==0.21.2" "trl==1.16.0" "tensorboard==2.21.0" "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-crt==13.0.*")
stamp="$venv/.strata-complete"

# The stamp is written last, so an interrupted install is finished on the next run, not trusted.
if [ "$(cat "$stamp" 2>/dev/null)" != "${packages[*]}" ]; then
  echo "strata setup: installing ${packages[*]} into $venv (about 5 GiB, once per machine)" >&2
  mkdir -p "$cache"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${packages[@]}"
  printf '%s' "${packages[*]}" >"$stamp"
fi

torch_dir=$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
ln -sfn "$venv" "$repo/.venv"
ln -sfn "$torch_dir" "$repo/.libtorch"
echo "strata setup: libtorch $TORCH_VERSION at $torch_dir" >&2
