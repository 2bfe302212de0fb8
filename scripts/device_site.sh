#!/usr/bin/env bash
# Packs the Python packages a GPU host lacks into .whl/site.tar.xz, for a host with no package index
# (the project's device machines: Python 3.12 with torch, triton, numpy, accelerate, tokenizers, but no
# datasets, pyarrow, pandas or jsonschema, and older transformers). ~45 MB, under the 64 MiB a device
# call carries. On the host (the bench and scripts/world_gpu.sh do this when the file is there):
#   mkdir -p /tmp/sp/site-packages && tar -xJf .whl/site.tar.xz -C /tmp/sp/site-packages
#   export PYTHONPATH=$PWD:/tmp/sp/site-packages
# The folder's name must contain "site-packages": dill (datasets' fingerprint) pickles any module
# outside such a path by value and fails on pyarrow ("Can't pickle <class 'MonthDayNano'>").
#   bash scripts/device_site.sh            # needs pip and ~300 MB of scratch space
set -euo pipefail
# the project's own pins, read from pyproject.toml (a bump there reaches the host), less what the host
# has (its CUDA torch, numpy, accelerate, tqdm) or no bench job imports (Snakemake, matplotlib) ...
mapfile -t pins < <(python3 - <<'PY'
import tomllib
skip = {"torch", "numpy", "accelerate", "tqdm", "snakemake", "matplotlib"}
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    spec = dep.replace(" ", "")
    name = spec.split("=")[0].split("<")[0].split(">")[0]
    if name not in skip:
        print(spec)
PY
)
# ... plus the packages those need that the host lacks (datasets' and jsonschema's dependencies)
pins+=(pyarrow==26.0.1 pandas==3.1.1 "dill<0.4.2" "multiprocess<0.70.20" xxhash "fsspec<=2026.9.0" attrs
       jsonschema-specifications referencing rpds-py)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp/wheels" "${pins[@]}"
site="$tmp/site-packages"
mkdir -p "$site"
for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" "$site"; done  # a wheel is a zip of its files
# what no job imports: Arrow Flight (27 MB), headers, test suites
rm -rf "$site"/pyarrow/libarrow_flight.so* "$site"/pyarrow/_flight*.so "$site"/pyarrow/include \
  "$site"/pyarrow/src "$site"/pyarrow/tests "$site"/pandas/tests
mkdir -p .whl
tar -cf - -C "$site" . | xz -T0 -6 > .whl/site.tar.xz.part
mv .whl/site.tar.xz.part .whl/site.tar.xz
ls -l .whl/site.tar.xz
