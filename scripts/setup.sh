#!/usr/bin/env bash
# Set-up behind `make demo` and `make test`: system build tools when missing, a .venv at the
# repository root with torch 2.13.0 and the development packages, then the editable build.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
python_bin="$(command -v python3.11 || command -v python3)"
"$python_bin" -c "import venv, ensurepip" >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need_apt[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $python_bin"
  "$python_bin" -m venv .venv
fi
stamp=.venv/.tokamax-deps
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0" setuptools wheel \
      pytest numpy hypothesis tqdm matplotlib expecttest \
      "transformers==5.25.0"  # tests/test_integrations_transformers.py (the optional extra)
  touch "$stamp"
fi
# --no-build-isolation: build against the torch in .venv, never a freshly downloaded one.
.venv/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
