#!/usr/bin/env bash
# Installs Debian's headless-capable Chromium and its WebDriver for tests/test_browser.py, when missing.
# `make test` runs it as a prerequisite (Makefile target `browser`).
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
