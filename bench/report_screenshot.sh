#!/usr/bin/env bash
# Regenerates docs/report-screenshot.png: the HTML report of a short demo stream on the CPU
# (default: Token2Wav at its real configuration, flow and HiFT, shadow audit on; a few minutes on
# 2 cores), rendered by headless Chromium (Debian: apt-get install chromium).
# Usage: bash bench/report_screenshot.sh [MODEL] [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-token2wav}"
out="$(pwd)/${2:-docs/report-screenshot.png}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m cadence_fx.cli report --model "$model" --full --verify --html "$tmp/report.html"
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$tmp/profile" --screenshot="$out" --window-size=1400,2000 \
  "file://$tmp/report.html" 2>/dev/null
echo "wrote $out"
