#!/usr/bin/env bash
# A/B of the spread gate-up in the step (experiment; run on the device from the repo root)
OUT=${OUT:-/tmp/o}; mkdir -p $OUT/ab; export PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation -q >/dev/null 2>&1
pre_items='import sys, megastep.kernels.moe_lut as m; m.SPREAD_ROWS = 0'
pre_gu='import sys, megastep.kernels.moe_lut as m
orig = m.down
def down(*a, **k):
    s = m.SPREAD_ROWS; m.SPREAD_ROWS = 0
    try: orig(*a, **k)
    finally: m.SPREAD_ROWS = s
m.down = down'
main='
import megastep, megastep.kernels.moe_lut as mm; print("module", megastep.__file__, "SPREAD_ROWS", mm.SPREAD_ROWS, "down patched", mm.down.__module__)
from megastep.cli import main; sys.exit(main(sys.argv[1:]))'
run() { # name pre extra...
  local name=$1 pre=$2; shift 2
  timeout 120 python3 -c "$pre$main" bench --preset v4-flash --context 4096 --iters 20 --layers 30 --batch 1,2 \
    --json $OUT/ab/$name.json "$@" > $OUT/ab/$name.log 2>&1
  echo "== $name"; grep -E "^module|^ +(1|2) " $OUT/ab/$name.log
}
run items "$pre_items"
run gu "$pre_gu"
run gu_early "$pre_gu" --shared-after-router off
run items_early "$pre_items" --shared-after-router off
run items_b "$pre_items"
run gu_b "$pre_gu"
run both_b "import sys"
