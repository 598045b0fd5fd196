"""offload_llama.py's main with a variant for diagnosis, chosen by environment variables: PRIO=p runs every kernel of
the run on a current stream of priority p (lower is higher); CARVEOUT=n leaves n SMs out of cuBLAS's matmuls;
TRACE_DIR=folder traces each rank's last training step into folder/rankR.json (--profile is one GPU's flag)."""

import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

import offload_llama as ol  # noqa: E402

rank = int(os.environ.get("RANK", "0"))
plain_parse, plain_steps = ol.parse_args, ol.train_steps


def parse_args(argv=None):
    """parse_args, then the variant's stream and carve-out on this rank's GPU."""
    run = plain_parse(argv)
    if os.environ.get("PRIO"):
        stream = torch.cuda.Stream(priority=int(os.environ["PRIO"]))
        torch.cuda.set_stream(stream)
        print(f"rank {rank}: current stream priority {stream.priority}", file=sys.stderr)
    if os.environ.get("CARVEOUT"):
        torch._C._set_sm_carveout_experimental(int(os.environ["CARVEOUT"]))
    return run


def train_steps(trainer, micro_batches, run, keep_grads, profile=None, *rest, **named):
    """train_steps with the last step traced into this rank's file."""
    folder = os.environ["TRACE_DIR"]
    os.makedirs(folder, exist_ok=True)
    return plain_steps(trainer, micro_batches, run, keep_grads, f"{folder}/rank{rank}.json", *rest, **named)


ol.parse_args = parse_args
if os.environ.get("TRACE_DIR"):
    ol.train_steps = train_steps
sys.exit(ol.main(sys.argv[1:]))
