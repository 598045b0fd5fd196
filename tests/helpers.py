"""Small models and runs shared by the CPU and GPU tests."""
import copy
import subprocess
import sys
from pathlib import Path

import torch

import offload_llama as ol

SCRIPT = Path(__file__).resolve().parents[1] / "offload_llama.py"


def tiny_run(**sizes) -> ol.RunConfig:
    return ol.RunConfig(preset="tiny", sizes=tuple(sizes.items()), batch_size=2, seq_len=48)


def build(run: ol.RunConfig):
    """A random model from `run`, its input ids, and its logits from the plain HF forward on the CPU."""
    model = ol.build_model(run, ol.llama_config(run))
    ids = ol.random_input_ids(run, model.config.vocab_size)
    return model, ids


def streamed_logits(model, ids, device, depth, pin=False, streamer_hook=None):
    """Logits of the offloaded model with layers streamed at `depth`; the store is built from `model`."""
    store = ol.ParamStore(model, pin=pin)
    streamer = ol.LayerStreamer(store, model.config, torch.device(device), depth)
    if streamer_hook:
        streamer_hook(streamer)
    shell = ol.offloaded_model(model, streamer, torch.device(device))
    with torch.inference_mode():
        return ol.logits_of(shell, ids.to(device)).cpu()


def resident_logits(model, ids, device):
    with torch.inference_mode():
        return ol.logits_of(copy.deepcopy(model).to(device), ids.to(device)).cpu()


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
