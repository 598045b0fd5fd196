#!/usr/bin/env bash
# The GPU tests (calls/gpu_tests.sh), then training's step against its bound (blocked and overlapped, then overlapped
# at --grad-accum 4) while the call's 600 s last: each run's log and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
bash calls/gpu_tests.sh
run() {  # run NAME LIMIT ARGS...: one training run, if LIMIT seconds are left before 585
  local name=$1 limit=$2; shift 2
  if (( SECONDS + limit > 585 )); then echo "$name skipped: $SECONDS s spent"; return; fi
  timeout $limit python3 offload_llama.py --train --no-inference --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$? at $SECONDS s"
  grep -E "^\| (blocked|overlapped)|bound, each part" $OUT/$name.log | cut -c1-400
}
run bo1 130 --mode blocked,overlapped
run ga4 100 --mode overlapped --grad-accum 4
