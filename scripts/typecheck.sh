#!/usr/bin/env bash
# Types: `mypy --strict` of the examples, which reaches the package's public API (vovp resolves
# to python/vovp, the native module through python/vovp/_native.pyi; config: [tool.mypy] in
# python/pyproject.toml). Runs after scripts/test.sh, whose venv (.venv) has numpy, torch and
# Ray: mypy reads their annotations there. mypy itself is installed into that venv on first use.
# VOVP_TYPECHECK_PYTHON: another interpreter with numpy, torch and Ray (mypy installed into it
# when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${VOVP_TYPECHECK_PYTHON:-${VOVP_VENV:-.venv}/bin/python}"
# Absolute: the package check below runs from python/.
case "$PYTHON" in /*) ;; *) PYTHON="$PWD/$PYTHON" ;; esac
if [ ! -x "$PYTHON" ]; then
    echo "typecheck: no interpreter at $PYTHON (run scripts/test.sh first, or set VOVP_TYPECHECK_PYTHON)" >&2
    exit 1
fi
if ! "$PYTHON" -c "import mypy" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet "mypy>=1.10"
fi
"$PYTHON" -m mypy --version
# The cache beside the other build outputs (git-ignored), not in the source tree.
"$PYTHON" -m mypy --config-file python/pyproject.toml --cache-dir target/typecheck/mypy-cache \
    --strict examples/*.py
# The whole package too (vovp.plasma is reached by no example), from python/ so that `vovp`
# is the source tree's.
(cd python && "$PYTHON" -m mypy --config-file pyproject.toml --cache-dir ../target/typecheck/mypy-cache \
    --strict -p vovp)
