# side NAME: issue 58 item 5, the old script (485e3ae, calls/old_offload.py) and the new one side by side on GPU 0:
# 7b-8l, overlapped, inference then 60 training steps, one after the other.
side() {
  for s in old new; do
    f=offload_llama.py; [ $s = old ] && f=calls/old_offload.py
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 $f --mode overlapped --train --steps 60 --json $O/side_${s}_$1.json > $O/side_${s}_$1.md 2> $O/side_${s}_$1.log
    echo "side $s $1 rc $? at $SECONDS s"
  done
}
