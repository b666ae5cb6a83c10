#!/usr/bin/env bash
# Builds .gpu/, what tests/gpu/check.sh needs on a GPU machine that has no package index
# and no Redis (this workplace's: Python 3.12 with torch, aiohttp, numpy, uvloop, pytest):
#   .gpu/whl/  cp312 wheels of the project's other dependencies and the test plugins;
#   .gpu/bin/  redis-server and redis-cli from this machine (x86-64), with .gpu/lib/ the
#              shared libraries they need beyond glibc, found by ldd.
# Run here (with network to the package registry), then carry .gpu to the GPU machine:
#   bash tests/gpu/bundle.sh && <device run, carry .gpu> bash tests/gpu/check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/whl .gpu/bin .gpu/lib
# The versions this checkout's venv runs, so the GPU run tests what CI tests.
pins=$($PY -m pip list --format=freeze 2>/dev/null | grep -i -E \
  '^(redis|hiredis|orjson|msgpack|pytest|pytest-asyncio|pytest-timeout|pluggy|iniconfig|fakeredis|lupa|sortedcontainers|prometheus.client|typing.extensions)==')
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl $pins
for exe in redis-server redis-cli; do
  cp "$(command -v $exe)" .gpu/bin/
  # glibc's own libraries stay the machine's; the rest (jemalloc, lzf, ssl, systemd...) travel
  ldd "$(command -v $exe)" | awk '/=> \//{print $3}' | grep -v -E '/lib(c|m|pthread|dl|rt)\.so' \
    | xargs -r -I{} cp -L -n {} .gpu/lib/
done
du -sh .gpu
