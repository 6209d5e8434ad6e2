#!/usr/bin/env bash
# tests/html_render_test.sh — the diff's HTML report renders in a real browser: headless
# Chromium (Debian's `chromium`) loads it, its DOM holds the verdict, the heatmap and the
# token strip with the divergence marked, and a screenshot is produced.
# Usage: html_render_test.sh LOCKSTEP_BINARY SOURCE_DIR
set -u
LS=$1
SRC=$2
CHROME=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$CHROME" ]; then
  echo "SKIP: no chromium on this machine (tools/install-deps.sh installs Debian's chromium)"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
FIX=$SRC/tests/fixtures/models/v3_basic
"$LS" record -m "$FIX" --prompt-ids 5,6,7,8,9,10,11,12 -n 6 -o "$TMP/a.h5" -q --logits full || exit 1
"$LS" replay "$TMP/a.h5" --mode forced --kv-cache fp8_e4m3 -o "$TMP/b.h5" -q --html "$TMP/report.html" >/dev/null || exit 1
FLAGS=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --user-data-dir="$TMP/profile")
timeout 60 "$CHROME" "${FLAGS[@]}" --dump-dom "file://$TMP/report.html" >"$TMP/dom.html" 2>"$TMP/chrome.log"
fail=0
grep -q 'id="verdict"' "$TMP/dom.html" || { echo "FAIL: rendered DOM lacks the verdict"; fail=1; }
grep -q 'First divergence' "$TMP/dom.html" || { echo "FAIL: the verdict names no divergence"; fail=1; }
cells=$(grep -o '<td style="background:#' "$TMP/dom.html" | wc -l)
[ "$cells" -ge 30 ] || { echo "FAIL: heatmap has $cells cells"; fail=1; }
grep -q 'class="tok gen div"\|class="tok div"' "$TMP/dom.html" || { echo "FAIL: no token marked as the divergence"; fail=1; }
timeout 60 "$CHROME" "${FLAGS[@]}" --window-size=1200,900 --screenshot="$TMP/shot.png" "file://$TMP/report.html" \
  >/dev/null 2>>"$TMP/chrome.log"
size=$(stat -c %s "$TMP/shot.png" 2>/dev/null || echo 0)
[ "$size" -gt 5000 ] || { echo "FAIL: screenshot missing or empty ($size bytes)"; tail -5 "$TMP/chrome.log"; fail=1; }
[ $fail -eq 0 ] && echo "ok: report rendered in $($CHROME --version 2>/dev/null | head -1): $cells heatmap cells, screenshot $size bytes"
exit $fail
