#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv with the pinned environment.
# Sourced by the other scripts; idempotent: it reinstalls only when the lock changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DELTASYNC_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

_deltasync_setup() {
    local base log
    base="$(command -v python3.11 || command -v python3)"
    log="$VENV.setup.log"
    echo "setting up $VENV with the pinned environment (about 2 minutes the first time) ..." >&2
    "$base" -m venv "$VENV" &&
    "$PY" -m pip install --upgrade "pip>=25" >"$log" 2>&1 &&
    # --no-deps: the lock is a complete, resolved environment; torch is the CPU build.
    "$PY" -m pip install --no-deps -r "$ROOT/requirements/lock.txt" >>"$log" 2>&1 &&
    # PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch.
    { "$PY" -m pip uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true; } &&
    "$PY" -m pip install --no-deps -e "$ROOT" >>"$log" 2>&1
}

want="$(cat "$ROOT/requirements/lock.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$PY" ] || [ "$(cat "$VENV/.lock-hash" 2>/dev/null)" != "$want" ]; then
    if ! _deltasync_setup; then
        echo "environment setup failed; the last lines of $VENV.setup.log:" >&2
        tail -n 30 "$VENV.setup.log" >&2
        exit 1
    fi
    echo "$want" > "$VENV/.lock-hash"
fi
export PATH="$VENV/bin:$PATH"
# One-time C++ builds (DeepSpeed's shared-memory communication op, about 100 s) live with the venv.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
