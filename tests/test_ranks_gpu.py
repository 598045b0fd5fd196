"""Two GPUs under torchrun: the CLI's data-parallel training (NCCL all-gathers and reduce-scatters, each rank's
shard of the host state) against one GPU training on every micro-batch of the same command."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import SCRIPT, assert_masters_close

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
TINY = ["--preset", "tiny", "--mode", "overlapped", "--train", "--seq-len", "256", "--steps", "5"]


def run(args, ranks: int | None, timeout=300):
    """The command line on one GPU (ranks None) or under torchrun with `ranks` processes."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    if ranks is None:
        env["CUDA_VISIBLE_DEVICES"] = "0"
        command = [sys.executable, str(SCRIPT), *map(str, args)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(SCRIPT)]
        command += list(map(str, args))
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize(("dtype", "batch", "accum"), [("float32", 2, 2), ("bfloat16", 4, 4)])
def test_two_gpus_train_as_one_on_every_micro_batch(tmp_path, dtype, batch, accum):
    """Two ranks, each with half the step's micro-batches: the masters of one GPU with all of them to float32
    rounding, the losses to 1e-6 relative; rank 0 alone prints and writes, with both ranks' peaks."""
    args = [*TINY, "--dtype", dtype, "--attention", "eager", "--batch-size", batch, "--grad-accum", accum]
    one = run([*args, "--save-output", tmp_path / "one.pt", "--json", tmp_path / "one.json"], None)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run([*args, "--save-output", tmp_path / "two.pt", "--json", tmp_path / "two.json"], 2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("Table 1 (training)") == 1  # rank 0's tables alone
    ref = torch.load(tmp_path / "one.pt")["training"]["overlapped"]
    got = torch.load(tmp_path / "two.pt")["training"]["overlapped"]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert_masters_close(got["masters"], ref["masters"], 5)
    result = json.loads((tmp_path / "two.json").read_text())["results"]["overlapped"]["training"]
    assert [r["peak_gpu_bytes"] > 0 for r in result["ranks"]] == [True, True]
    assert result["peak_host_bytes"] == sum(r["peak_host_bytes"] for r in result["ranks"])


def test_more_ranks_than_gpus_are_refused_in_one_line():
    """Three ranks on two GPUs: one line, exit 2, before a model is built."""
    n = torch.cuda.device_count() + 1
    done = run([*TINY, "--grad-accum", n, "--batch-size", n], n, timeout=120)
    assert done.returncode != 0
    assert f"torchrun started {n} ranks on this host, which has" in done.stderr
