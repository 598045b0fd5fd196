"""report/find_largest.py: the search, the host-memory limit, and a real search on the CPU (probes in fresh
processes)."""

import importlib.util
import json
import subprocess
import sys

import pytest

import offload_llama as ol
from helpers import SCRIPT, host_for, tiny_run

TOOL = SCRIPT.parent / "report" / "find_largest.py"
spec = importlib.util.spec_from_file_location("find_largest", TOOL)
fl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fl)


def find_largest(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("first", [1, 3, 7, 12])
@pytest.mark.parametrize("threshold", [0, 1, 5, 12])
def test_search_finds_the_largest_that_trains(threshold, first):
    probed = []

    def trains(n):
        probed.append(n)
        return n <= threshold

    assert fl.largest_that_trains(trains, first, upper=12) == threshold
    assert len(set(probed)) == len(probed) and all(1 <= n <= 12 for n in probed)
    if first == threshold and 0 < threshold < 12:
        assert probed == [threshold, threshold + 1]  # a right first guess costs two probes


def host_total(run, layers: int) -> int:
    """The least host memory `run` with `layers` decoder layers plans with: its floor, with no copy of the masters and
    two gradient buffers (training state, passes, the process)."""
    run = fl.with_layers(run, layers)
    return sum(ol.host_parts(run, ol.llama_config(run), fl.machine(run), None, 2).values())


@pytest.fixture(autouse=True)
def steady_process(monkeypatch):
    """The process's own memory, which the plans count, fixed: it grows as the tests run."""
    monkeypatch.setattr(ol, "process_rss", lambda: ol.GiB)


def test_host_limit_counts_the_training_state_of_each_layer(monkeypatch):
    run = ol.dataclasses.replace(tiny_run(), train=True, mode="overlapped")
    total = host_for(host_total(run, 3))
    monkeypatch.setattr(ol, "host_memory_available", lambda: total)
    assert fl.host_layer_limit(run, "overlapped") == 3
    total = host_for(host_total(run, 3)) - 1
    monkeypatch.setattr(ol, "host_memory_available", lambda: total)
    assert fl.host_layer_limit(run, "overlapped") == 2
    gpu = ol.dataclasses.replace(run, mode="gpu")  # --max-host-memory caps what the kernel has available
    assert (
        fl.host_layer_limit(ol.dataclasses.replace(gpu, max_host_memory=host_for(host_total(gpu, 5)) / ol.GiB), "gpu")
        == 5
    )


@pytest.mark.slow  # probes in processes of their own: 4 s
def test_host_limit_with_the_disk_tier_counts_the_disk(monkeypatch, tmp_path):
    """With --nvme, more layers fit: some layers' moments go to the disk, as far as its free space takes them (the
    staging buffers cost the host DISK_SLOTS layers' moments, so a few layers on the disk buy nothing)."""
    run = ol.dataclasses.replace(tiny_run(), train=True, mode="overlapped", nvme=str(tmp_path))
    total = host_for(host_total(run, 20))
    monkeypatch.setattr(ol, "host_memory_available", lambda: total)
    layer = ol.disk_unit_bytes(ol.llama_config(run))
    limits = []
    for disk_layers in (0, 20, 40):
        room = ol.shutil._ntuple_diskusage(0, 0, disk_layers * layer)
        monkeypatch.setattr(ol.shutil, "disk_usage", lambda _, room=room: room)
        limits.append(fl.host_layer_limit(run, "overlapped"))
        found = fl.with_layers(run, limits[-1])
        assert ol.make_plan(found, ol.llama_config(found), fl.machine(found)).disk_layers <= disk_layers
        more = fl.with_layers(run, limits[-1] + 1)
        assert ol.plan_refusal(more, ol.llama_config(more), fl.machine(more)) is not None
    assert limits[0] == 20 < limits[1] < limits[2]


@pytest.mark.slow
def test_a_disk_as_large_as_needed_is_arithmetic_from_the_run_found(monkeypatch, tmp_path):
    """With --nvme, the search adds what a disk as large as needed would give (marked as arithmetic): the most layers
    the host holds with their moments on the disk, and the step found scaled by the disk bytes."""
    run = ol.dataclasses.replace(tiny_run(), train=True, mode="overlapped", nvme=str(tmp_path))
    total = host_for(host_total(run, 20))
    monkeypatch.setattr(ol, "host_memory_available", lambda: total)
    layer = ol.disk_unit_bytes(ol.llama_config(run))
    monkeypatch.setattr(ol.shutil, "disk_usage", lambda _: ol.shutil._ntuple_diskusage(0, 0, 5 * layer))
    limit = fl.host_layer_limit(run, "overlapped")
    d = fl.large_disk(run, "overlapped", {"training": {"time_ms": 100.0, "disk_tier": {"bytes": 5 * layer}}})
    assert limit < d["layers"] < fl.LARGE_DISK_LAYERS and 5 < d["disk_layers"] <= d["layers"]
    more = fl.with_layers(run, d["layers"] + 1)
    assert "host memory" in ol.plan_refusal(more, ol.llama_config(more), fl.machine(more, fl.math.inf))  # no more
    assert d["disk_bytes"] == d["disk_layers"] * layer and d["step_ms"] == pytest.approx(100.0 * d["disk_layers"] / 5)
    assert "(arithmetic from the run above, not measured)" in fl.large_disk_line("overlapped", d)
    assert fl.large_disk(run, "overlapped", {"training": {"time_ms": 100.0}}) is None  # no disk tier in the run


@pytest.mark.parametrize("flags", [{}, {"inference": False, "offload_activations": True, "fwd_bwd_reference": True}])
def test_a_probe_runs_the_cli_with_the_same_settings(flags):
    run = ol.RunConfig(
        mode="overlapped",
        preset="tiny",
        sizes=(("num_hidden_layers", 3), ("vocab_size", 300)),
        dtype="float16",
        attention="eager",
        batch_size=2,
        seq_len=64,
        seed=5,
        prefetch=2,
        warmup=0,
        repeat=2,
        max_gpu_memory=11.5,
        json="r.json",
        train=True,
        steps=3,
        grad_accum=2,
        lr=3e-4,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=0.01,
        **flags,
    )
    assert ol.parse_args(fl.cli_args(run)) == run


def test_a_lean_run_counts_no_compute_copy_of_the_model():
    """Training one offloaded mode without inference draws the random model straight into the masters: the host
    never holds it in the compute dtype; with inference it does, 2 bytes a parameter in bfloat16. Either way the
    masters take 4 bytes a parameter and the moments 8 (the units' padding included)."""
    lean = ol.dataclasses.replace(tiny_run(), mode="overlapped", train=True, inference=False, dtype="bfloat16")
    config, facts = ol.llama_config(lean), fl.machine(lean)
    padded = sum(ol.shard_numels(config, ol.Ranks()))
    parts = ol.host_parts(lean, config, facts, None, 2)
    assert lean.lean and parts["model"] == 0
    assert parts["float32 masters"] == 4 * padded and parts["Adam moments"] == 8 * padded
    full = ol.dataclasses.replace(lean, inference=True)
    assert not full.lean and ol.host_parts(full, config, facts, None, 2)["model"] == 2 * ol.param_count(config)
    assert not ol.dataclasses.replace(lean, mode="gpu,overlapped").lean


@pytest.mark.slow
def test_cli_find_largest_on_the_cpu(tmp_path):
    out = tmp_path / "r.json"
    r = find_largest(
        "--mode", "cpu", "--preset", "tiny", "--seq-len", "16", "--steps", "2", "--warmup", "1", "--json", out
    )
    assert r.returncode == 0, r.stderr
    found = json.loads(out.read_text())["find_largest"]["cpu"]
    assert found["layers"] == fl.MAX_SEARCH_LAYERS and "search stops" in found["limited_by"]
    assert len(found["training"]["losses"]) == 2 and found["training"]["time_ms"] > 0
    assert f"probe cpu, {fl.MAX_SEARCH_LAYERS} layers" in r.stderr and "The largest model that trains" in r.stdout


@pytest.mark.slow  # a process of its own, importing torch: 11 s
def test_find_largest_needs_a_preset(tmp_path):
    r = find_largest("--model", tmp_path)
    assert r.returncode == 2 and "--preset" in r.stderr


def test_the_layer_past_the_host_limit_is_refused_for_host_memory(monkeypatch):
    """Unprobed, the layer past the host's limit says what the plan needs of the host (check_host's line)."""
    run = ol.dataclasses.replace(tiny_run(), train=True, mode="overlapped")
    total = host_for(host_total(run, 3))
    monkeypatch.setattr(ol, "host_memory_available", lambda: total)
    why = fl.limit(run, "overlapped", ol.llama_config(run), 3, None)
    assert why.startswith("with 4 layers, the run needs") and "of host memory" in why, why


def test_the_layer_past_the_disk_limit_is_refused_for_the_disk(monkeypatch, tmp_path):
    """Unprobed, the layer past the limit that the host would hold, were the disk larger, names the disk."""
    run = ol.dataclasses.replace(tiny_run(), train=True, mode="overlapped", nvme=str(tmp_path))
    total = host_for(host_total(run, 3))
    monkeypatch.setattr(ol, "host_memory_available", lambda: total)
    monkeypatch.setattr(ol.shutil, "disk_usage", lambda _: ol.shutil._ntuple_diskusage(0, 0, 0))  # no room on it
    n = fl.host_layer_limit(run, "overlapped")
    why = fl.limit(run, "overlapped", ol.llama_config(run), n, None)
    assert n == 3 and why.startswith(f"with {n + 1} layers, --nvme {tmp_path}: "), why
    assert "of Adam moments" in why and "more than is free there" in why


@pytest.mark.slow  # a probe under torchrun: 4 s
def test_a_probe_under_torchrun_reads_a_ranks_refusal_through_its_summary(monkeypatch, tmp_path):
    """--nproc-per-node 2: the probe is torchrun's, whose exit code is 1 for any rank's failure; a rank's one-line
    refusal (exit 2) is read from torchrun's summary, as one process's would be."""
    script = tmp_path / "refuses.py"
    script.write_text('import sys\nprint("offload_llama.py: error: no room", file=sys.stderr)\nsys.exit(2)\n')
    monkeypatch.setattr(fl, "SCRIPT", script)
    run = ol.dataclasses.replace(tiny_run(), train=True, grad_accum=2, ranks=ol.Ranks(0, 2, 0, 2))
    assert fl.probe(run, "overlapped", 2) == {"refused": "no room"}


def test_a_refusal_is_read_where_another_ranks_line_ran_into_it():
    """Ranks share stderr: a line of two refusals run together gives one reason, and a line without one gives none."""
    assert fl.refusal_in("no roomoffload_llama.py: error: no room\n") == "no room"
    assert fl.refusal_in("offload_llama.py: error: --steps must be positive (see --help)\n") == (
        "--steps must be positive (see --help)"
    )
    assert fl.refusal_in("probe overlapped, 8 layers: trains\n") == ""


@pytest.mark.slow  # a process of its own, importing torch: 10 s
def test_find_largest_splits_the_step_over_its_ranks(tmp_path):
    r = find_largest("--nproc-per-node", 2, "--preset", "tiny", "--mode", "overlapped", "--grad-accum", 3)
    assert r.returncode == 2 and "use a multiple of 2" in r.stderr, r.stderr
