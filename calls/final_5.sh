#!/usr/bin/env bash
# Issue 72 at e5dc161 on one H200, call 5: where 88 layers' 12% lower executed TFLOPS (402) than the resident model's
# with its layers recomputed (458, 7b-8l at --grad-accum 4) comes from: 7b-8l at --grad-accum 16 with segments of 2
# and no graph kept (the 88-layer run's recompute), against the gpu mode's rows at the same shape, then a trace of
# the segments' step. Logs and JSON under $OUT; give it 300 s.
source calls/runs.sh
run seg2 80 --mode overlapped --grad-accum 16 --segment 2
run gpu16 90 --mode gpu --grad-accum 16
timeout 80 python3 offload_llama.py --train --no-inference --mode overlapped --grad-accum 16 --segment 2 --steps 3 \
  --warmup 1 --repeat 1 --profile $OUT/seg2_trace.json > $OUT/seg2_trace.log 2>&1
echo "trace rc=$? at $SECONDS s"; ls -la $OUT
cd $OUT && gzip -f seg2_trace.json* ; tar czf rows.tar.gz seg2.* gpu16.* && rm seg2.* gpu16.*
