#!/usr/bin/env bash
# Regenerates the measured results on a GPU machine: JSON, tables (.md), logs and profiler traces under OUTDIR.
#   bash report/run_benchmarks.sh OUTDIR [PART ...]   (default: every part, in the order below)
set -euo pipefail
parts="bf16 prefetch fp32 train alone activations train_fp32 accum eager largest largest_disk disk clip scale peers budget"
parts="$parts budget_ab ablations small_host quests text"
out=${1:?usage: run_benchmarks.sh OUTDIR [PART ...], with PART one of: $parts}; shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
# NAME COMMAND...: the command's JSON, stdout (its tables) and stderr (its progress) as OUTDIR/NAME.{json,md,log}
record() { local name=$1; shift; "$@" --json "$out/$name.json" 2> >(tee "$out/$name.log" >&2) | tee "$out/$name.md"; }
run() { local name=$1; shift; record "$name" python3 offload_llama.py "$@"; }
# DeepSpeed, for the peers, from the wheels that travel in wheels/ (report/peers.py says how they are made)
if [ -d wheels ] && ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "${TMPDIR:-/tmp}/deepspeed" wheels/*.whl
  export PYTHONPATH="${TMPDIR:-/tmp}/deepspeed${PYTHONPATH:+:$PYTHONPATH}"
fi
for p in ${@:-$parts}; do
  case $p in
    bf16) run inference_bf16 --mode all --dtype bfloat16 --profile "$out/trace_overlapped_bf16.json" ;;
    prefetch) for d in 2 3; do run "inference_bf16_prefetch$d" --mode overlapped --dtype bfloat16 --prefetch "$d"; done ;;
    fp32) run inference_fp32 --mode all --dtype float32 ;;
    # the cpu mode trains at about 20 s a step: 2 steps
    train) run train_bf16 --mode gpu,blocked,overlapped --train --dtype bfloat16 --profile "$out/trace_bf16.json"
           run train_bf16_cpu --mode cpu --train --steps 2 --dtype bfloat16 ;;
    # each mode training alone in a process of its own: the peak host memory of its training state (the train part
    # also holds the inference store and gpu mode's gradients and masters on the host, for the comparison), and the
    # step time as a median of 58 steps
    alone) for m in gpu blocked overlapped; do
             run "train_bf16_$m" --mode "$m" --train --no-inference --steps 60 --dtype bfloat16
           done ;;
    # what activation offload costs where it is not needed: one micro-batch, and 16 against the accum part
    activations) run train_bf16_offload_acts --mode overlapped --train --no-inference --offload-activations \
                   --dtype bfloat16
                 run train_bf16_accum16_offload_acts --mode overlapped --train --no-inference --offload-activations \
                   --grad-accum 16 --steps 5 --warmup 1 --dtype bfloat16 ;;
    # float32 compute: the GPU work outlasts the copies
    train_fp32) run train_fp32 --mode gpu,blocked,overlapped --train --steps 5 --warmup 1 --dtype float32 ;;
    accum) run train_bf16_accum16 --mode gpu,overlapped --train --grad-accum 16 --steps 5 --warmup 1 --fwd-bwd-reference \
             --dtype bfloat16 ;;
    # bitwise gradients at full size: eager attention, whose backward is deterministic
    eager) run train_bf16_eager --mode gpu,overlapped --train --steps 3 --warmup 1 --attention eager --dtype bfloat16 ;;
    # LLaMA-7B-sized layers under an 11 GiB GPU cap, with and without offload
    largest) record largest_llama7b python3 report/find_largest.py --preset llama-7b --max-gpu-memory 11 --steps 4 \
               --warmup 1 --dtype bfloat16 ;;
    # the same with the disk tier: Adam moments of the layers the host cannot hold on the disk of NVME_DIR (unnamed
    # files, freed at exit; default OUTDIR's disk)
    largest_disk) record largest_llama7b_disk python3 report/find_largest.py --preset llama-7b --max-gpu-memory 11 \
                    --steps 3 --warmup 1 --dtype bfloat16 --mode overlapped --nvme "${NVME_DIR:-$out}" ;;
    # 7b-8l with the moments of half its layers on the disk, against all on the host
    disk) base=(--mode overlapped --train --no-inference --steps 12 --warmup 2 --dtype bfloat16)
          run disk_7b8l_host "${base[@]}"
          run disk_7b8l_half "${base[@]}" --nvme "${NVME_DIR:-$out}" --nvme-layers 4 ;;
    # what clipping costs: every unit's update waits for the whole backward (and the GPU's Adam share is 0)
    clip) base=(--mode overlapped --train --no-inference --steps 12 --warmup 2 --dtype bfloat16 --gpu-adam-share 0)
          run clip_7b8l_unclipped "${base[@]}"
          run clip_7b8l_clipped "${base[@]}" --clip-grad-norm 1.0 ;;
    # LLaMA-7B on 64 x 1024 tokens a step under an 11 GiB cap (activation offload turns itself on), keeping resident
    # what the cap holds, against plain forward and backward of the model resident on the GPU; training alone, so no
    # bfloat16 copy of the layers
    scale) run train_llama7b_65k --preset llama-7b --mode overlapped --train --no-inference --grad-accum 16 \
             --batch-size 4 --seq-len 1024 --max-gpu-memory 11 --steps 5 --warmup 1 \
             --fwd-bwd-reference \
             --dtype bfloat16 ;;
    # time against the GPU budget: gpu mode and every unit streamed (no cap) at the two ends, then overlapped under
    # each cap, keeping resident what it holds (80: the whole GPU); BUDGETS="ends 4 6" runs some of them only
    budget) for gib in ${BUDGETS:-ends 4 6 8 11 16 24 80}; do
              if [ "$gib" = ends ]; then
                run budget_ends --mode gpu,overlapped --train --steps 12 --warmup 2 --repeat 3 --dtype bfloat16
              else
                run "budget_$gib" --mode overlapped --train --max-gpu-memory "$gib" --steps 12 --warmup 2 --repeat 3 \
                  --dtype bfloat16
              fi
            done ;;
    # training under 11 GiB against every unit streamed, three times each, interleaved: the step time of one process
    # varies by up to 20% with the host (where its pinned memory lands), so one run of each does not settle the ratio
    budget_ab) for i in 1 2 3; do
                 run "budget_ab_streamed_$i" --mode overlapped --train --no-inference --steps 12 --warmup 2 --dtype bfloat16
                 run "budget_ab_11_$i" --mode overlapped --train --no-inference --max-gpu-memory 11 --steps 12 --warmup 2 \
                   --dtype bfloat16
               done ;;
    # report tooling: accelerate, FSDP2 and DeepSpeed ZeRO-3 and ZeRO-2 on the same model and batch
    peers) record peers_bf16 python3 report/peers.py --dtype bfloat16 ;;
    # the report's section 11 (build_report.ablations_section), 7b-8l training alone: the GPU's Adam over streamed state
    # off, at its default share and with one layer more; prefetch 3 with every unit on the CPU Adam; FSDP2 again, and
    # the default step again last, minutes after the first (the host's noise)
    ablations) base=(--mode overlapped --train --no-inference --steps 70 --warmup 5 --repeat 5 --dtype bfloat16)
               for share in 0 0.3 0.4; do run "ablation_share_$share" "${base[@]}" --gpu-adam-share "$share"; done
               run ablation_share_0_prefetch3 "${base[@]}" --gpu-adam-share 0 --prefetch 3
               record ablation_fsdp2 python3 report/peers.py --peers fsdp2 --dtype bfloat16
               run ablation_share_0.3_again "${base[@]}" --gpu-adam-share 0.3 ;;
    # a small host: 7b-8l (1.88B parameters, more than GPT2-XL's 1.5B) on 64 x 1024 tokens a step under an 11 GiB GPU
    # cap and a 16 GiB host cap, the Adam moments the host cannot hold on the disk of NVME_DIR (default OUTDIR's)
    small_host) run small_host_7b8l --preset 7b-8l --mode overlapped --train --no-inference --grad-accum 64 \
                  --batch-size 1 --seq-len 1024 --max-gpu-memory 11 --max-host-memory 16 --nvme "${NVME_DIR:-$out}" \
                  --steps 8 --warmup 2 --repeat 2 --dtype bfloat16 ;;
    # seed 001's quest: GPT2-XL's shape (48 layers of 1600, 25 heads, vocabulary 50257, an MLP of its parameter
    # count in LLaMA's three matrices) on 64 x 1024 tokens a step under an 11 GiB GPU cap and a 16 GiB host cap, the
    # moments the host cannot hold on the disk of NVME_DIR, against plain forward and backward of the resident model
    quests) run quest_gpt2xl --hidden-size 1600 --layers 48 --heads 25 --kv-heads 25 --vocab-size 50257 \
              --intermediate-size 4267 --mode overlapped --train --no-inference --grad-accum 16 --batch-size 4 \
              --seq-len 1024 --max-gpu-memory 11 --max-host-memory 16 --nvme "${NVME_DIR:-$out}" --fwd-bwd-reference \
              --steps 5 --warmup 1 --repeat 2 --dtype bfloat16 ;;
    # training on text: the Python standard library's own .py files (site-packages left out) as the corpus, an 8k
    # byte-level BPE trained on it, an 843M-parameter LLaMA from random weights for one epoch under an 11 GiB GPU cap;
    # then 40 steps of the same shape on the same corpus (its token cache hit) and on random ids, to compare the steps
    text) corpus=${TMPDIR:-/tmp}/stdlib_corpus
          python3 -c "
import pathlib, shutil, sys, sysconfig
src, dst = pathlib.Path(sysconfig.get_paths()['stdlib']), pathlib.Path(sys.argv[1])
for f in src.rglob('*.py'):
    if f.relative_to(src).parts[0] != 'site-packages' and f.is_file():
        (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst / f.relative_to(src))" "$corpus"
          model=(--hidden-size 2048 --intermediate-size 5504 --layers 16 --heads 16 --kv-heads 16 --vocab-size 8192)
          base=(--mode overlapped --train --no-inference "${model[@]}" --seq-len 1024 --batch-size 8 --grad-accum 2
                --max-gpu-memory 11 --dtype bfloat16)
          data=(--data "$corpus" --data-glob "*.py" --skip-undecodable --train-tokenizer 8192
                --data-cache "$out/text_cache")
          run text_stdlib "${base[@]}" "${data[@]}" --epochs 1 --eval-every 50 --lr 2e-4 --warmup 5 --repeat 3 \
            --sample "def " --sample "import os" --sample "class Stack:" --sample-tokens 48
          run text_steps_data "${base[@]}" "${data[@]}" --steps 40 --warmup 5 --repeat 2
          run text_steps_random "${base[@]}" --steps 40 --warmup 5 --repeat 2
          rm -rf "$out/text_cache" "$corpus" ;;
    *) echo "unknown part $p: choose from $parts" >&2; exit 2 ;;
  esac
done
