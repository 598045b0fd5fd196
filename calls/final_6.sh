#!/usr/bin/env bash
# Issue 72 at e5dc161 on one H200, call 6: the trace of calls/final_5.sh summarised on the device (67 MB does not
# come back): 7b-8l at --grad-accum 16 with segments of 2, whose GPU compute ran 15% slower per FLOP than the gpu
# mode with its layers recomputed. Give it 200 s.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee $OUT/version.txt
timeout 100 python3 offload_llama.py --train --no-inference --mode overlapped --grad-accum 16 --segment 2 --steps 3 \
  --warmup 1 --repeat 1 --profile /tmp/seg2_trace.json > $OUT/seg2_trace.log 2>&1
echo "trace rc=$? at $SECONDS s"; ls -la /tmp/seg2_trace*
for f in /tmp/seg2_trace*.json; do echo "== $f"; timeout 60 python3 calls/trace_summary.py $f; done 2>&1 | tee $OUT/summary.txt
