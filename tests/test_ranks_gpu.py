"""Two GPUs under torchrun: the CLI's data-parallel training (NCCL all-gathers and reduce-scatters, each rank's
shard of the host state) against one GPU training on every micro-batch of the same command."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import offload_llama as ol
from helpers import SCRIPT, assert_masters_close, assert_same_checkpoint

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
STEPS = 5
TINY = ["--preset", "tiny", "--mode", "overlapped", "--train", "--seq-len", "256", "--steps", STEPS]


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


def trained(tmp_path, args, ranks):
    """The overlapped mode's losses and final masters, and the JSON's training results, of the command line."""
    name = f"ranks_{ranks}"
    done = run([*args, "--save-output", tmp_path / f"{name}.pt", "--json", tmp_path / f"{name}.json"], ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())["results"]["overlapped"]["training"]
    return torch.load(tmp_path / f"{name}.pt")["training"]["overlapped"], result, done.stdout


@pytest.mark.parametrize(("dtype", "accum"), [("float32", 2), ("bfloat16", 2), ("bfloat16", 4)])
def test_two_gpus_train_as_one_on_every_micro_batch(tmp_path, dtype, accum):
    """Two ranks, each with half the step's micro-batches, against one GPU with all of them: the losses to 1e-6
    relative; rank 0 alone prints and writes, with both ranks' peaks. One micro-batch a rank: the gradients' float32
    sum is the one GPU's (two terms), so the masters agree to float32 rounding (the CPU and GPU Adams round apart).
    Two a rank: the sum's order differs, (g0 + g2) + (g1 + g3) against ((g0 + g1) + g2) + g3, and where a sum nearly
    cancels Adam turns its rounding into a step of up to the learning rate: nearly every master still agrees to
    float32 rounding, none by more than twice the steps' learning rates."""
    args = [*TINY, "--dtype", dtype, "--attention", "eager", "--batch-size", 2, "--grad-accum", accum]
    ref, _, _ = trained(tmp_path, args, None)
    got, result, stdout = trained(tmp_path, args, 2)
    assert stdout.count("Table 1 (training)") == 1  # rank 0's tables alone
    assert [r["peak_gpu_bytes"] > 0 for r in result["ranks"]] == [True, True]
    assert result["peak_host_bytes"] == sum(r["peak_host_bytes"] for r in result["ranks"])
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    if accum == 2:
        assert_masters_close(got["masters"], ref["masters"], STEPS)
        return
    largest = max(m.abs().max().item() for m in ref["masters"].values())
    apart = [(got["masters"][name] - m).abs() for name, m in ref["masters"].items()]
    beyond = sum((d > ol.masters_tolerance(largest, STEPS)).sum().item() for d in apart)
    most = max(d.max().item() for d in apart)
    assert beyond <= 1e-3 * sum(d.numel() for d in apart), (beyond, most)
    assert most <= 2 * STEPS * ol.RunConfig.lr, (beyond, most)  # a step of +lr on one side, -lr on the other


def test_more_ranks_than_gpus_are_refused_in_one_line():
    """Three ranks on two GPUs: one line, exit 2, before a model is built."""
    n = torch.cuda.device_count() + 1
    done = run([*TINY, "--grad-accum", n, "--batch-size", n], n, timeout=120)
    assert done.returncode != 0
    assert f"torchrun started {n} ranks on this host, which has" in done.stderr


@pytest.mark.parametrize("extra", [["--clip-grad-norm", "0.05"], ["--dtype", "float16"], ["--gpu-adam-share", "0.5"]])
def test_two_gpus_compose_with_clipping_float16_and_the_gpus_adam(tmp_path, extra):
    """Clipping (the norm over every rank's shards), float16 (the overflow agreed by both ranks) and the GPU's Adam
    over each rank's shard of its units, one micro-batch a rank: the losses and masters of one GPU."""
    args = [*TINY, "--attention", "eager", "--batch-size", 2, "--grad-accum", 2, "--dtype", "float32", *extra]
    ref, ref_result, _ = trained(tmp_path, args, None)
    got, result, _ = trained(tmp_path, args, 2)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-3 if "float16" in extra else 1e-6)
    assert_masters_close(got["masters"], ref["masters"], STEPS)
    assert result.get("grad_norms", []) == pytest.approx(ref_result.get("grad_norms", []), rel=1e-6)


def test_two_gpus_resume_their_shards_bitwise_and_save_a_folder(tmp_path):
    """6 steps against 3, then 3 more resumed from each rank's shards, both on two GPUs: the same checkpoint bit for
    bit; the one run's --save-pretrained folder loads the trained masters bit for bit."""
    one, two, folder = tmp_path / "one", tmp_path / "two", tmp_path / "hf"
    args = [*TINY, "--batch-size", 2, "--grad-accum", 2, "--dtype", "bfloat16"]
    saved = ["--save-pretrained", folder, "--save-output", tmp_path / "o.pt"]
    first = run([*args, "--steps", 6, "--checkpoint", one, *saved], 2)
    assert first.returncode == 0, first.stderr[-3000:]
    for steps, resumed in ((3, []), (3, ["--resume", two])):
        done = run([*args, "--steps", steps, "--checkpoint", two, *resumed], 2)
        assert done.returncode == 0, done.stderr[-3000:]
    assert_same_checkpoint(one, two)
    masters = torch.load(tmp_path / "o.pt")["training"]["overlapped"]["masters"]
    loaded = ol.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[name], t) for name, t in masters.items())


def worker_pid(parent: int, rank: int) -> int:
    """The pid of torchrun's worker `rank`, a child of `parent` (from /proc: its parent and its RANK)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return int(stat.parent.name)
    raise AssertionError(f"no worker of rank {rank} under pid {parent}")


def test_a_rank_killed_mid_step_ends_the_run_within_a_minute_naming_it():
    """SIGKILL to rank 1 of 2 while they train: rank 0 ends too, and torchrun exits non-zero within 60 s (never a
    hang), its summary naming rank 1."""
    args = [*TINY, "--steps", 2000, "--batch-size", 2, "--grad-accum", 2, "--no-inference"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT), *map(str, args)]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as torchrun:
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(torchrun.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 240
        while not any("  step 3:" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(worker_pid(torchrun.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        try:
            torchrun.wait(timeout=90)
        finally:
            torchrun.kill()
        seconds = time.monotonic() - killed
        reader.join(timeout=10)
    stderr = "".join(lines)
    assert torchrun.returncode != 0 and seconds < 60, (torchrun.returncode, seconds, stderr[-3000:])
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", stderr.partition("Root Cause")[2]), stderr[-3000:]
