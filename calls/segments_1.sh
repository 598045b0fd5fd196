#!/usr/bin/env bash
# Issue 72 after the plan weighs two ways of a backward in segments (remade, or a micro-batch at a time with the
# graphs), call 1 of 3: the GPU tests of segments (gpu mode's gradients bit for bit, the slot and buffer races),
# 88 LLaMA-7B layers at 64 x 1024 tokens under a 130 GiB cap (item 4: the plan takes segments of 3 a micro-batch at a
# time), GPT2-XL's shape under 11 GiB and 16 GiB (item 1) the plan's way (remade, by its flat 520 TFLOPS) and a
# micro-batch at a time (calls/ways.py), 7b-8l at --grad-accum 16 --segment 2. Logs and JSON under $OUT (GPT2-XL's
# and 7b-8l's in tars: 8 files come back); give it 600 s.
source calls/runs.sh
T="-p no:cacheprovider -rfE --tb=short --timeout 200"
timeout 150 python3 -m pytest $T -q tests/test_train_gpu.py -k "segment" > $OUT/seg_tests.log 2>&1
echo "segment tests rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/seg_tests.log | tail -8
timeout 200 python3 offload_llama.py --preset llama-7b --layers 88 --mode overlapped --train --no-inference \
  --grad-accum 16 --batch-size 4 --seq-len 1024 --max-gpu-memory 130 --steps 4 --warmup 1 --repeat 1 \
  --json $OUT/layers88.json > $OUT/layers88.log 2>&1
echo "layers 88 rc=$? at $SECONDS s"
grep -E "^\| overlapped |segments|step [0-9]:|peak resident|Error|error" $OUT/layers88.log | cut -c1-400
mkdir -p /tmp/nvme
shape=(--hidden-size 1600 --layers 48 --heads 25 --kv-heads 25 --vocab-size 50257 --intermediate-size 4267)
gpt2xl=("${shape[@]}" --max-gpu-memory 11 --max-host-memory 16 --nvme /tmp/nvme --seq-len 1024 --batch-size 4
  --grad-accum 16 --mode overlapped --train --no-inference --steps 5 --warmup 1 --repeat 2)
for way in plan graphs; do
  if (( SECONDS > 470 )); then echo "gpt2xl_$way skipped: $SECONDS s spent"; continue; fi
  script=offload_llama.py; [[ $way == graphs ]] && script="calls/ways.py graphs"
  extra=(); [[ $way == plan ]] && extra=(--fwd-bwd-reference)
  timeout 120 python3 $script "${gpt2xl[@]}" "${extra[@]}" --json $OUT/gpt2xl_$way.json > $OUT/gpt2xl_$way.log 2>&1
  echo "gpt2xl_$way rc=$? at $SECONDS s"
  grep -E "^\| overlapped|segments|reference|peak resident|Error|error" $OUT/gpt2xl_$way.log | cut -c1-400
done
run seg2 80 --mode overlapped --grad-accum 16 --segment 2
cd $OUT && tar czf gpt2xl.tar.gz gpt2xl_* && rm gpt2xl_*; ls seg2.* > /dev/null 2>&1 && tar czf seg2.tar.gz seg2.* && rm seg2.*
ls $OUT
