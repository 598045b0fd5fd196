"""Two GPUs (four where the machine has them) under torchrun: the CLI's data-parallel training (NCCL all-gathers and
reduce-scatters, each rank's shard of the host state) against one GPU training on every micro-batch of the same
command; the offloaded forward over every rank's PCIe link; checkpoints resumed on another number of ranks; two
launchers, as on two hosts."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_data import corpus

import offload_llama as ol
from helpers import SCRIPT, assert_masters_close, assert_same_checkpoint

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
FOUR = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs")
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


@pytest.mark.parametrize(
    ("dtype", "accum", "ranks"),
    [("float32", 2, 2), ("bfloat16", 2, 2), ("bfloat16", 4, 2), pytest.param("bfloat16", 4, 4, marks=FOUR)],
)
def test_gpus_train_as_one_on_every_micro_batch(tmp_path, dtype, accum, ranks):
    """`ranks` ranks, each with its share of the step's micro-batches, against one GPU with all of them: the losses to
    1e-6 relative; rank 0 alone prints and writes, with every rank's peaks. One micro-batch on each of two ranks: the
    gradients' float32 sum is the one GPU's (two terms), so the masters agree to float32 rounding (the CPU and GPU
    Adams round apart). More terms: the sum's order differs, (g0 + g2) + (g1 + g3) against ((g0 + g1) + g2) + g3,
    and where a sum nearly cancels Adam turns its rounding into a step of up to the learning rate: nearly every
    master still agrees to float32 rounding, none by more than twice the steps' learning rates."""
    args = [*TINY, "--dtype", dtype, "--attention", "eager", "--batch-size", 2, "--grad-accum", accum]
    ref, _, _ = trained(tmp_path, args, None)
    got, result, stdout = trained(tmp_path, args, ranks)
    assert stdout.count("Table 1 (training)") == 1  # rank 0's tables alone
    assert [r["peak_gpu_bytes"] > 0 for r in result["ranks"]] == [True] * ranks
    assert result["peak_host_bytes"] == sum(r["peak_host_bytes"] for r in result["ranks"])
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    if accum == ranks == 2:
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


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=FOUR)])
def test_ranks_run_the_offloaded_forward_to_one_gpus_logits_bitwise(tmp_path, ranks):
    """Inference over `ranks` ranks, each copying its shard of every layer and an all-gather the rest, every rank on
    the same batch: the logits of one GPU's offloaded forward, bit for bit."""
    args = ["--preset", "tiny", "--mode", "overlapped", "--seq-len", 256, "--batch-size", 2]
    logits = {}
    for n in (None, ranks):
        done = run([*args, "--save-output", tmp_path / f"{n}.pt"], n)
        assert done.returncode == 0, done.stderr[-3000:]
        logits[n] = torch.load(tmp_path / f"{n}.pt")["logits"]["overlapped"]
    assert torch.equal(logits[ranks], logits[None])


@pytest.mark.parametrize(("saved", "now"), [(2, 1), (1, 2)])
def test_a_checkpoint_of_n_gpus_goes_on_over_m(tmp_path, saved, now):
    """A checkpoint written by `saved` GPUs after 3 steps, resumed on `now` (one GPU: no torchrun): 3 more steps, one
    micro-batch a rank, reach the losses and masters of the `saved` GPUs going on from it, to float32 rounding (the
    two terms' sum is the same; the CPU and GPU Adams round apart). The bitwise restore of every pairing of 1 to 4
    ranks is test_ranks.py's."""
    launchers = {1: None, 2: 2}  # one GPU runs without torchrun
    args = [*TINY, "--dtype", "float32", "--attention", "eager", "--batch-size", 2, "--grad-accum", 2, "--steps", 3]
    first = run([*args, "--checkpoint", tmp_path / "saved"], launchers[saved])
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = [*args, "--resume", tmp_path / "saved"]
    ref, _, _ = trained(tmp_path, [*resumed, "--checkpoint", tmp_path / "ref"], launchers[saved])
    got, _, _ = trained(tmp_path, [*resumed, "--checkpoint", tmp_path / "got"], launchers[now])
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert_masters_close(got["masters"], ref["masters"], 6)


def launcher(node: int, port: int, args, log) -> subprocess.Popen:
    """One of two `torchrun --nnodes 2` launchers on this host, as on a host of its own: one rank, on GPU `node`; its
    output into the file `log` (a pipe left unread could fill and stop it while the other is waited for)."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    env["CUDA_VISIBLE_DEVICES"] = str(node)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
    command += ["--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", str(SCRIPT), *map(str, args)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def test_two_launchers_train_what_one_launchers_two_ranks_do(tmp_path):
    """`torchrun --nnodes 2` twice, a GPU each, each "host" tokenizing the corpus into its own --data-cache, one
    --checkpoint folder: the losses, evaluations, samples and checkpoint of one launcher's two ranks, bit for bit
    (two terms sum alike in either order)."""
    folder = corpus(tmp_path / "corpus")
    args = [*TINY, "--vocab-size", 512, "--seq-len", 64, "--batch-size", 2, "--grad-accum", 2, "--no-inference"]
    args += ["--data", folder, "--train-tokenizer", 300, "--eval-every", 3, "--sample", "def", "--sample-tokens", 8]
    alone = run(
        [*args, "--data-cache", tmp_path / "cache", "--checkpoint", tmp_path / "one", "--json", tmp_path / "1.json"], 2
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = [*args, "--checkpoint", tmp_path / "two", "--json", tmp_path / "2.json"]
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    with logs[0].open("w") as log0, logs[1].open("w") as log1:
        nodes = [
            launcher(n, port, [*two, "--data-cache", tmp_path / f"cache{n}"], log) for n, log in enumerate((log0, log1))
        ]
        codes = [node.wait(timeout=300) for node in nodes]
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
    results = [json.loads((tmp_path / f"{n}.json").read_text())["results"]["overlapped"]["training"] for n in (1, 2)]
    assert results[1]["losses"] == results[0]["losses"]
    assert results[1]["samples"] == results[0]["samples"]
    held_out = [[(e["step"], e["tokens"], e["loss"]) for e in r["evaluations"]] for r in results]  # less their times
    assert held_out[1] == held_out[0]
    assert_same_checkpoint(tmp_path / "one", tmp_path / "two")
    assert [len(list((tmp_path / f"cache{node}").glob("tokens-*.bin"))) for node in (0, 1)] == [1, 1]
