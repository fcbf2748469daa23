#!/bin/sh
# Headless Chromium from the Debian packages, for the HTML page's browser test
# (tests/plugin/test_html.py: it skips, saying to run this script, when /usr/bin/chromium is absent).
set -eu
if [ -x /usr/bin/chromium ]; then
    echo "chromium already installed: $(/usr/bin/chromium --version)"
    exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update
$SUDO apt-get install -y chromium
/usr/bin/chromium --version
