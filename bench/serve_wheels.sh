#!/usr/bin/env bash
# Download the wheels the serve extra needs on the device into .whl_serve/ (git-ignored), in
# carries that each fit one device call (64 MiB): the ray wheel (~79 MB) split in two parts,
# then every dependency a torch install lacks. bench/serve_device.sh installs them there.
#   bash bench/serve_wheels.sh            # then see bench/serve_device.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl_serve
rm -rf "$OUT" && mkdir -p "$OUT/all" "$OUT/c1" "$OUT/c2" "$OUT/c3"
# the device's Python (3.12) and platform, whatever this machine is; torch and what it brings are there
pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$OUT/all" \
  "ray[serve]==2.56.0" "protobuf>=3.20,<7" "websockets>=13"
rm -f "$OUT"/all/{torch,nvidia_,triton,sympy,mpmath,networkx,jinja2,MarkupSafe,fsspec,setuptools}[-_]*.whl
RAY=$(ls "$OUT"/all/ray-2.56.0-*.whl)
split -b 40m -d "$RAY" "$OUT/c1/$(basename "$RAY").part"
mv "$OUT/c1/$(basename "$RAY").part01" "$OUT/c2/"
sha256sum "$RAY" | sed "s#$OUT/all/##" > "$OUT/c2/ray.sha256"
rm "$RAY"
mv "$OUT"/all/*.whl "$OUT/c3/"
du -sh "$OUT"/c1 "$OUT"/c2 "$OUT"/c3
