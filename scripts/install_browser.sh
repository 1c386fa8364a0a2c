#!/usr/bin/env bash
# The real-browser test (tests/test_browser.py) needs Debian's Chromium; Playwright comes with the test extra.
# Installs chromium with apt-get when it is missing and we are root; otherwise says how (the test then skips).
set -uo pipefail
if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "[install_browser] installing Debian's chromium for the browser test"
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
    || echo "[install_browser] could not install chromium; the browser test will be skipped"
else
  echo "[install_browser] chromium missing: run 'sudo apt-get install chromium' to enable the browser test"
fi
exit 0
