#!/usr/bin/env bash
# Installs Debian's headless-capable Chromium and its WebDriver for tests/test_browser.py, when missing.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium chromium-driver
