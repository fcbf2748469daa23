#!/usr/bin/env bash
# Make venv DST hold what venv SRC has installed, by hard links, less the distributions named:
#   scripts/seed_venv.sh SRC DST [DISTRIBUTION ...]
# Why: the CI machine's disk is small. The vLLM 0.34 and no-engine venvs share torch, FlashInfer and CUTLASS
# (about 2.5 GB with their bytecode) with the main venv, and a CI run once ran out of disk installing them.
# Linked, a second venv costs only what differs. The two stay apart: pip removes a file and writes a new one, it
# never writes into an installed file, and so does Python when it writes bytecode.
# Exit 0: DST is made. Exit 1: nothing was made (no SRC, another Python, DST exists, or no hard links across the
# file systems); the caller then makes DST as usual. Console scripts are not linked: run `DST/bin/python -m pip`.
set -euo pipefail
SRC=${1:?usage: scripts/seed_venv.sh SRC DST [DISTRIBUTION ...]}
DST=${2:?usage: scripts/seed_venv.sh SRC DST [DISTRIBUTION ...]}
shift 2
[ -x "$SRC/bin/python" ] || exit 1
[ ! -e "$DST" ] || exit 1
version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$("$SRC/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$version" ] || exit 1
site_src="$SRC/lib/python$version/site-packages"
site_dst="$DST/lib/python$version/site-packages"
[ -d "$site_src" ] || exit 1
python3 -m venv --without-pip "$DST"
trap 'rm -rf "$DST"' ERR  # a half-made DST is not left for the caller
rm -rf "$site_dst"
if ! cp -al "$site_src" "$site_dst" 2>/dev/null; then
    echo "seed_venv.sh: cannot hard-link $site_src into $DST; installing instead" >&2
    rm -rf "$DST"
    exit 1
fi
for dist in "$@"; do
    if "$DST/bin/python" -m pip show -q "$dist" >/dev/null 2>&1; then
        "$DST/bin/python" -m pip uninstall -y -q "$dist"
    fi
done
echo "seed_venv.sh: $DST linked from $SRC${*:+, without $*}"
