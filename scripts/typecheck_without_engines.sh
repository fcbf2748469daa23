#!/usr/bin/env bash
# Strict mypy where no engine is installed (issue 53): a contributor who works on the core without vLLM or SGLang
# gets the same clean run. Makes VENV (default .venv-core: torch==2.13.0 CPU and this project with its test extras,
# no engine), then runs mypy as pyproject.toml configures it. A new VENV is first linked from the main venv
# ($KVPROFILE_SEED_VENV, default ROOT/.venv; empty: never) without vLLM and SGLang, by scripts/seed_venv.sh.
#   scripts/typecheck_without_engines.sh [VENV]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv-core}
SEED=${KVPROFILE_SEED_VENV-$ROOT/.venv}
if [ ! -x "$VENV/bin/python" ]; then
    if [ -z "$SEED" ] || ! "$ROOT/scripts/seed_venv.sh" "$SEED" "$VENV" vllm sglang; then
        python3 -m venv "$VENV"
    fi
fi
"$VENV/bin/python" -m pip install -q torch==2.13.0 -e "$ROOT[test]"
for engine in vllm sglang; do
    if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$engine') is None)"; then
        echo "$VENV has $engine installed: this check needs a venv without the engines" >&2
        exit 2
    fi
done
cd "$ROOT"
exec "$VENV/bin/python" -m mypy
