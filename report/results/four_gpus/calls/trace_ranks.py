"""offload_llama.py's main under torchrun with each rank's last training step traced (--profile is one GPU's flag):
the trace of rank R goes to $TRACE_DIR/rankR.json. Diagnosis only."""

import os
import sys

sys.path.insert(0, os.getcwd())
import offload_llama as ol  # noqa: E402

folder = os.environ["TRACE_DIR"]
os.makedirs(folder, exist_ok=True)
rank = int(os.environ.get("RANK", "0"))
plain = ol.train_steps


def traced(trainer, micro_batches, run, keep_grads, profile=None, *rest, **named):
    """train_steps with the last step traced into this rank's file."""
    return plain(trainer, micro_batches, run, keep_grads, f"{folder}/rank{rank}.json", *rest, **named)


ol.train_steps = traced
sys.exit(ol.main(sys.argv[1:]))
