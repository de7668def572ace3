#!/usr/bin/env bash
# bench/serve.py on a device machine, which has no network and no Ray. The wheels come from
# bench/serve_wheels.sh (run it here first: .whl_serve/c1, c2, c3, each under one call's 64 MiB
# carry). A warm device keeps /tmp between calls that follow each other within seconds, so three
# consecutive calls carry them, the last one installs and runs:
#   run(carry=[".whl_serve/c1"], command="bash bench/serve_device.sh 1")
#   run(carry=[".whl_serve/c2"], command="bash bench/serve_device.sh 2")
#   run(carry=[".whl_serve/c3", ".whl"], command="bash bench/serve_device.sh 3 [--gpus 2]")
# (.whl: the model wheels of bench/device.sh; the Token2Wav replicas need minicpmo.) Call 3 within
# seconds of call 2: an idle device goes back after 30 s and /tmp with it.
# Step 3 writes bench/results/<date>-h200-serve.json (under $OUT too, to bring it back). On
# nvidia-h200-x2, pass --gpus 2 for the scaling ratio. If step 3 finds a part missing (the
# machine went cold between calls), start again at step 1.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?give the step: 1, 2 or 3}
shift
W=/tmp/cfx_serve_wheels
mkdir -p "$W"
case "$STEP" in
  1|2) cp .whl_serve/c"$STEP"/* "$W"/ && ls -la "$W" ;;
  3)
    cp .whl_serve/c3/* "$W"/
    RAY=$(basename "$(ls "$W"/ray-*.whl.part00)" .part00)
    cat "$W/$RAY".part00 "$W/$RAY".part01 > "$W/$RAY"
    (cd "$W" && sha256sum -c ray.sha256)
    # python -m pip: the device's bare `pip` belongs to another Python than the `python` that runs
    python -m pip install --no-index --find-links "$W" "$W/$RAY[serve]" "protobuf>=3.20,<7" "websockets>=15"
    if ls .whl/*.whl >/dev/null 2>&1; then python -m pip install --no-deps .whl/*.whl; fi   # the models
    python -m pip install --no-deps --no-build-isolation -e .
    DATE=$(date +%F)
    OUT_JSON=bench/results/$DATE-h200-serve.json
    CADENCE_COMMIT=${CADENCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} \
      python bench/serve.py --out "$OUT_JSON" "$@" || status=$?
    [ -n "${OUT:-}" ] && cp "$OUT_JSON" "$OUT"/ || true   # rows written before a failure too
    exit "${status:-0}"
    ;;
  *) echo "step must be 1, 2 or 3" >&2; exit 2 ;;
esac
