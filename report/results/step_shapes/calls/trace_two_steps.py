"""Call G's investigation (issue 56): a Chrome trace of two consecutive training steps, so the boundary between them
shows, gzipped. Run from the repository root on the GPU machine: python3 trace_two_steps.py OUT FLAGS..., with the
flags of a training run; the last step is replaced by an untraced step and two traced ones."""

import gzip
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, ".")
import offload_llama as ol  # noqa: E402


def profile_two(trainer, micro_batches, path):
    """Two steps traced after one untraced: the first's updates overlap the second's forward."""
    trainer.step(micro_batches).item()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        config = None
    with torch.profiler.profile(activities=activities, experimental_config=config) as prof:
        trainer.step(micro_batches).item()
        loss = trainer.step(micro_batches).item()
        trainer.finish()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return {"loss": loss, "path": path, "h2d": ol.trace_overlap(path, "HtoD"), "d2h": ol.trace_overlap(path, "DtoH")}


def main(out: str, flags: list[str]) -> None:
    """Run the flags with the two-step trace, then gzip the trace beside it."""
    ol.profile_step = profile_two
    ol.main([*flags, "--profile", f"{out}/trace.json"])
    trace = f"{out}/trace.train.json"
    events = json.loads(Path(trace).read_text())["traceEvents"]
    with gzip.open(trace + ".gz", "wt") as f:
        json.dump(events, f)
    os.remove(trace)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
