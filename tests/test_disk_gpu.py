"""The disk tier (--nvme) on the GPU: overlapped training with the last layers' Adam moments staged from the disk
equals the host-only run bit for bit, with and without the GPU's Adam share, through the trainer and the command
line; a disk that fails ends the run with one line and exit code 1, and nothing is left under the folder."""

import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

import offload_llama as ol
from helpers import SCRIPT, build, cli_all, offloaded_trainer, tiny_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")

# eager attention: a backward that is bitwise reproducible, so two runs can be compared bit for bit
OVERLAPPED = ["--preset", "tiny", "--layers", "6", "--seq-len", "64", "--mode", "overlapped", "--train"]
OVERLAPPED += ["--no-inference", "--attention", "eager", "--steps", "4", "--warmup", "1", "--repeat", "1"]


def states(trainer) -> list[dict]:
    """Every unit's step count, master and moments."""
    return [ol.unit_state(trainer, u) for u in range(len(trainer.units))]


@pytest.mark.parametrize("gpu_adam", [(), (0, 1)])
def test_overlapped_with_the_disk_tier_trains_bitwise_as_the_host(gpu_adam, tmp_path):
    """The last three of 5 layers on the disk, through fewer staging buffers than them; the GPU's Adam steps the
    embeddings and first layer over streamed state, or nothing."""
    model, ids = build(ol.dataclasses.replace(tiny_run(num_hidden_layers=5), attention="eager"))
    batches = [ids.to(CUDA)]
    trainers = {
        "host": offloaded_trainer(model, CUDA, 1, batches, pin=True, gpu_adam=gpu_adam),
        "disk": offloaded_trainer(model, CUDA, 1, batches, pin=True, gpu_adam=gpu_adam, disk=(tmp_path, (3, 4, 5))),
    }
    result = {}
    for name, trainer in trainers.items():
        losses = [trainer.step(batches).item() for _ in range(4)]
        trainer.finish()
        result[name] = losses, states(trainer)
        assert os.listdir(tmp_path) == []
    assert result["disk"][0] == result["host"][0]
    for disk, host in zip(result["disk"][1], result["host"][1], strict=True):
        assert disk["step"] == host["step"]
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert all(torch.equal(disk[key][name], host[key][name]) for name in host[key]), key
    trainers["disk"].store.close()


def test_cli_with_the_disk_tier_trains_bitwise_as_the_host(tmp_path):
    """--nvme with --nvme-layers 3 against no disk: the same trained masters; the JSON holds the tier's figures and
    its part of the bound; the folder is empty after the run."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    runs = {
        "host": [*OVERLAPPED, "--save-output", tmp_path / "host.pt", "--json", tmp_path / "host.json"],
        "disk": [*OVERLAPPED, "--save-output", tmp_path / "disk.pt", "--json", tmp_path / "disk.json"],
    }
    runs["disk"] += ["--nvme", nvme, "--nvme-layers", "3"]
    done = cli_all(runs)
    assert all(r.returncode == 0 for r in done.values()), [r.stderr for r in done.values()]
    assert "the Adam moments of 3 decoder layers" in done["disk"].stderr
    host, disk = (torch.load(tmp_path / f"{name}.pt")["training"]["overlapped"] for name in ("host", "disk"))
    assert disk["losses"] == host["losses"]
    assert all(torch.equal(disk["masters"][name], m) for name, m in host["masters"].items())
    training = ol.json.loads((tmp_path / "disk.json").read_text())["results"]["overlapped"]["training"]
    assert training["disk_tier"]["units"] == 3 and training["disk_ms"] > 0
    assert "Adam moments of 3 units" in done["disk"].stdout  # the tables' notes
    assert os.listdir(nvme) == []


def test_a_disk_that_fails_ends_the_run_with_one_line(tmp_path):
    """Files capped at 64 KiB (RLIMIT_FSIZE): reserving the tier's files fails, exit code 1 with one line naming the
    folder, after the checks; nothing is left under it."""

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, 2**16))

    r = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, OVERLAPPED), "--nvme", str(tmp_path), "--nvme-layers", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=small_files,
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("offload_llama.py: error: File too large"), r.stderr
    assert f"{tmp_path} (the --nvme disk tier)" in last and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []
