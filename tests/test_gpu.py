"""GPU tier: bitwise equality with the resident model, hostile races, overlap in a trace, memory bounds."""

import json
import os
import subprocess
import sys

import pytest
import torch

import offload_llama as ol
from helpers import SCRIPT, build, cli, resident_logits, streamed_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
CONFIGS = {
    "gqa-3-layers": {**SMALL, "num_hidden_layers": 3},
    "one-layer": {**SMALL, "num_hidden_layers": 1},
    "mha-5-layers": {**SMALL, "num_hidden_layers": 5, "num_key_value_heads": 8},
}
# low arithmetic intensity: 100 MB of bf16 weights per layer against 16 tokens, so a copy takes milliseconds
# and a layer's compute microseconds: a missing wait shows up as wrong numbers, not as luck
THIN = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 256,
    "num_hidden_layers": 4,
}


def gpu_run(sizes, dtype="bfloat16", seq_len=256, batch_size=2):
    return ol.RunConfig(preset="tiny", sizes=tuple(sizes.items()), dtype=dtype, seq_len=seq_len, batch_size=batch_size)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("name", CONFIGS)
def test_offloaded_logits_bitwise_equal_gpu(name, depth, dtype):
    model, ids = build(gpu_run(CONFIGS[name], dtype))
    expected = resident_logits(model, ids, "cuda")
    assert torch.equal(streamed_logits(model, ids, "cuda", depth, pin=True), expected)


def delay_copies(streamer):
    """Each layer's weights land 20 ms late, into slots that hold NaN before: compute that does not wait for them
    reads NaN, however fast the CPU issues it."""
    for buffer in streamer.buffers:
        buffer.fill_(float("nan"))
    wait_source = streamer.writer.wait_written  # called just before each copy is issued

    def late(u):
        wait_source(u)
        with torch.cuda.stream(streamer.copy_stream):
            torch.cuda._sleep(40_000_000)

    streamer.writer.wait_written = late


def drop_copied_wait(streamer):
    """The compute stream no longer waits for a slot's copy to land."""
    streamer.copied = [ol.InOrder() for _ in streamer.copied]


def drop_freed_wait(streamer):
    """The copy stream no longer waits for the slot's previous layer to finish."""
    streamer.freed = [ol.InOrder() for _ in streamer.freed]


def stretch_compute(streamer):
    """Each layer's kernels start 20 ms late, so an early copy into its slot would overwrite its weights first."""
    for layer in (slot["layer"] for slot in streamer.modules):
        layer.register_forward_pre_hook(lambda module, args: torch.cuda._sleep(40_000_000))


def both(*hooks):
    def hook(streamer):
        for h in hooks:
            h(streamer)

    return hook


RACES = {
    # the copy is slow and the compute instant: compute runs ahead onto a slot still being filled
    "copied": (delay_copies, both(delay_copies, drop_copied_wait)),
    # the compute is stretched and the copy fast: the next copy overwrites a slot still to be read
    "freed": (stretch_compute, both(stretch_compute, drop_freed_wait)),
}


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("race", RACES)
def test_race_each_wait_is_needed(race, depth):
    intact, broken = RACES[race]
    model, ids = build(gpu_run(THIN, seq_len=16, batch_size=1))
    expected = resident_logits(model, ids, "cuda")
    assert torch.equal(streamed_logits(model, ids, "cuda", depth, pin=True, streamer_hook=intact), expected)
    assert not torch.equal(streamed_logits(model, ids, "cuda", depth, pin=True, streamer_hook=broken), expected)


def seven_b(layers, seq_len=4096):
    """CLI flags for LLaMA-7B-sized layers: at 4096 tokens, copy (7 ms) and compute (4 ms) per layer are comparable."""
    return ["--preset", "7b-8l", "--layers", layers, "--seq-len", seq_len, "--repeat", 3]


@pytest.mark.parametrize("mode", ["overlapped", "blocked"])
def test_trace_shows_copies_under_compute_only_when_overlapped(mode, tmp_path):
    r = cli("--mode", mode, *seven_b(3), "--profile", tmp_path / "trace.json", "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    trace = ol.trace_overlap(str(tmp_path / "trace.json"))
    assert trace["copy_ms"] > 0
    assert set(trace["copy_streams"]) - set(trace["kernel_streams"]), "the layer copies need a stream of their own"
    if mode == "overlapped":  # 2 of the 3 copies can run under the layer before, each for the shorter of the two
        timing = json.loads((tmp_path / "r.json").read_text())["results"]["overlapped"]["inference"]
        expected = 2 * min(timing["copy_ms_per_layer"], timing["compute_ms_per_layer"])  # this run's own times
        assert trace["overlap_ms"] > 0.5 * expected, (trace, timing)
        assert_peak_within_analytic_figure(r, tmp_path / "r.json")  # bfloat16, the default
    else:
        assert trace["overlap_ms"] < 0.05 * trace["copy_ms"], trace


MEMORY_RUNS = {  # run side by side by conftest's memory_runs
    # 6 layers of 7B need 2.4 GB resident: over a 2 GiB cap, while 2 slots and the head fit
    "oom": ["--mode", "all", *seven_b(6, seq_len=512), "--max-gpu-memory", 2],
    "float32": ["--mode", "overlapped", *seven_b(3), "--dtype", "float32"],
    # 8 x 2048 tokens: the layers' activations outweigh Adam's float32 state, so the plain row peaks in the backward
    "recomputed": ["--mode", "gpu", "--train", "--no-inference", *seven_b(2, seq_len=2048), "--batch-size", 8],
}


def test_the_resident_model_recomputed_has_its_own_row_and_a_smaller_peak(memory_runs):
    """Table 1 and 2 show gpu mode also with each decoder layer recomputed, as the offloaded modes recompute: its
    activations are the layers' inputs alone."""
    r, path = memory_runs["recomputed"]
    assert r.returncode == 0, r.stderr
    results = json.loads(path.read_text())["results"]
    plain, recomputed = results["gpu"]["training"], results["gpu_recomputed"]["training"]
    assert recomputed["peak_gpu_bytes"] < plain["peak_gpu_bytes"]
    assert "| w/o offload, layers recomputed (gpu) |" in r.stdout


def test_peak_memory_within_analytic_figure_in_float32(memory_runs):
    r, path = memory_runs["float32"]
    assert r.returncode == 0, r.stderr
    assert_peak_within_analytic_figure(r, path)


def assert_peak_within_analytic_figure(r, path):
    """The overlapped pass's peak GPU memory is within the analytic figure, which the table prints."""
    result = json.loads(path.read_text())["results"]["overlapped"]["inference"]
    analytic = sum(result["analytic_peak_bytes"].values())
    assert result["peak_gpu_bytes"] <= analytic, (result["peak_gpu_bytes"], result["analytic_peak_bytes"])
    assert f"| {sum(result['analytic_peak_bytes'].values()) / ol.GiB:.2f} |" in r.stdout  # the printed figure


def test_mode_that_does_not_fit_is_oom_and_others_run(memory_runs):
    r, path = memory_runs["oom"]
    assert r.returncode == 0, r.stderr
    results = json.loads(path.read_text())["results"]
    assert results["gpu"]["inference"] == {"oom": True}
    assert "| w/o offload (gpu) | OOM |" in r.stdout
    for mode in ("blocked", "overlapped", "cpu"):
        assert results[mode]["inference"]["time_ms"] > 0


def test_pinned_buffers_take_exactly_their_size_and_stream_both_ways():
    numel = 3 * 2**20 + 128  # just over a power of two of bytes: torch's pinned allocator would round it to 16 MiB
    host = ol.host_zeros(numel, torch.float32, pin=True)
    assert host.is_pinned() and host.untyped_storage().nbytes() == 4 * numel and not host.any()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        device = torch.arange(numel, dtype=torch.float32, device="cuda")
        host.copy_(device, non_blocking=True)
        back = host.to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(host, torch.arange(numel, dtype=torch.float32)) and torch.equal(back, device)


def test_the_command_line_grows_segments_in_place():
    """main's use_expandable_segments reaches the allocator, which reads it when CUDA starts, after the imports: a
    cap that the placement's prediction fits is then not refused for split segments."""
    code = "import torch, offload_llama as ol; ol.use_expandable_segments(); x = torch.empty(2**26, device='cuda'); "
    code += "print([s['is_expandable'] for s in torch.cuda.memory_snapshot() if s['segment_type'] == 'large'])"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=SCRIPT.parent)
    assert r.returncode == 0 and r.stdout.strip() == "[True]", r.stderr
