"""report/REPORT.md is exactly what report/build_report.py makes of the JSON kept under report/."""

import importlib.util
import json
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[1] / "report"


def build_report():
    spec = importlib.util.spec_from_file_location("build_report", REPORT / "build_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_is_rebuilt_exactly_from_the_json():
    assert build_report().main(["--check"]) == 0, "run python3 report/build_report.py"


def test_report_cites_every_json_it_reads():
    report = (REPORT / "REPORT.md").read_text()
    module = build_report()
    sources = [*module.SOURCES.values(), *module.LATER_SOURCES.values(), *module.RANK_SOURCES.values()]
    for path in [*sources, *module.TRACES.values()]:
        assert (REPORT / path).is_file() and f"`{path}`" in report


def test_each_group_of_results_was_made_by_one_version_of_the_script():
    """SOURCES by one version; LATER_SOURCES, the runs made after a change to the script, by one later version."""
    module = build_report()
    runs = module.load()
    for group in (module.SOURCES, module.LATER_SOURCES):
        versions = {name: runs[name]["script_sha256"] for name in group}
        assert len(set(versions.values())) == 1, versions
    assert module.script_version(runs) != module.script_version(runs, module.LATER_SOURCES)


def test_results_of_two_versions_stop_the_build():
    module = build_report()
    runs = module.load()
    runs["train_bf16"] = runs["train_bf16"] | {"script_sha256": "f" * 64}
    with pytest.raises(SystemExit, match="2 versions of offload_llama.py"):
        module.how_to_run(runs)


def test_every_part_the_report_names_ran_on_one_machine():
    module = build_report()
    parts = [part for machine in module.MACHINES for part in machine]
    assert len(parts) == len(set(parts))
    script = (REPORT / "run_benchmarks.sh").read_text()
    assert all(f"    {part})" in script for part in parts)


def test_the_budget_section_has_a_row_for_each_cap_and_pair():
    module = build_report()
    text = "\n".join(module.budget_section(module.load()))
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == (1 + 2 + len(module.BUDGETS)) + (1 + module.PAIRS)  # header, ends and caps; header and pairs


def test_budget_figure_builds_from_the_stored_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    module = build_report()
    module.budget_figure(module.load(), tmp_path / "budget.png")
    assert (tmp_path / "budget.png").stat().st_size > 0


def test_trace_lanes_give_the_gpu_adam_its_own_lane_and_leave_its_launches_out_of_the_cpu_adam(tmp_path):
    def event(name, cat, tid, ts, dur, external_id):
        return {
            "ph": "X",
            "name": name,
            "cat": cat,
            "tid": tid,
            "ts": ts,
            "dur": dur,
            "args": {"External id": external_id},
        }

    trace = {
        "traceEvents": [
            event("Torch-Compiled Region: 0/0", "cpu_op", 2, 0, 5000, 1),  # the CPU Adam thread
            event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 61, 1000, 1000, 2),
            event("nvjet_gemm", "kernel", 7, 2000, 3000, 3),  # the compute stream: the most kernel time
            event("aten::_fused_adam_", "cpu_op", 1, 5000, 10, 4),  # the main thread launches the GPU's Adam
            event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", "kernel", 73, 5100, 500, 4),
            event("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 77, 5600, 1000, 5),
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    lanes, end = build_report().trace_lanes(path)
    assert lanes == {
        "CPU Adam": [(0.0, 5.0)],
        "GPU Adam": [(5.1, 0.5)],
        "D2H copies": [(5.6, 1.0)],
        "H2D copies + casts": [(1.0, 1.0)],
        "GPU compute": [(2.0, 3.0)],
    }
    assert end == 6.6


def test_readme_results_quote_the_json(tmp_path):
    module = build_report()
    runs = module.load()
    assert module.readme_mismatches(runs) == []
    figure = module.readme_figures(runs)[0]
    changed = tmp_path / "README.md"
    changed.write_text(module.README.read_text().replace(figure, figure.replace("ms", "ms (changed)", 1)))
    assert module.readme_mismatches(runs, changed) == [figure]


def test_peers_without_deepspeed_say_so_in_their_rows(monkeypatch):
    """DeepSpeed is no requirement: where it cannot be imported, its rows are kept, saying so."""
    spec = importlib.util.spec_from_file_location("peers", REPORT / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    monkeypatch.setitem(__import__("sys").modules, "deepspeed", None)  # an import of it then fails
    run = peers.ol.RunConfig(preset="tiny")
    results = {f"zero{stage}": peers.deepspeed_training(None, None, run, stage) for stage in (3, 2)}
    table = peers.table(results, run, 96)
    assert all("DeepSpeed is not installed" in r["missing"] for r in results.values())
    assert "| DeepSpeed ZeRO-3, parameters and optimizer offloaded | training step |" in table
    assert table.count("DeepSpeed is not installed") == 2


def test_the_host_probe_writes_the_rates_section_13_reads(monkeypatch, tmp_path):
    """host_probe.py on the CPU alone (no GPU to copy to): each rate measured, the sum of the two together."""
    spec = importlib.util.spec_from_file_location("host_probe", REPORT / "host_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    monkeypatch.setattr(probe, "ELEMENTS", 2**16)
    monkeypatch.setattr(probe, "SECONDS", 0.05)
    monkeypatch.setattr(probe.torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(probe.torch, "set_num_threads", lambda n: None)  # the other tests keep this process's count
    monkeypatch.setattr("sys.argv", ["host_probe.py", "--json", str(tmp_path / "probe.json")])
    probe.main()
    rates = json.loads((tmp_path / "probe.json").read_text())
    assert rates["cpu_gbs"] > 0 and rates["together"]["cpu_gbs"] > 0 and rates["copies_gbs"] == 0
    assert rates["together"]["sum_gbs"] == rates["together"]["cpu_gbs"] + rates["together"]["copies_gbs"]


@pytest.mark.parametrize("figure", ["timeline_training.png", "timeline_inference.png"])
def test_a_trimmed_trace_draws_and_measures_the_same(figure, tmp_path):
    """trim_trace keeps what the figure's lanes and the overlap measurement read: both come out the same."""
    import offload_llama as ol

    module = build_report()
    full = tmp_path / "full.json"
    full.write_text((REPORT / module.TRACES[figure]).read_text())
    trimmed = tmp_path / "trimmed.json"
    trimmed.write_text(full.read_text())
    module.trim_trace(trimmed)
    module.trim_trace(trimmed)  # again: nothing changes
    assert module.trace_lanes(trimmed) == module.trace_lanes(full)
    for direction in ("HtoD", "DtoH"):
        assert ol.trace_overlap(str(trimmed), direction) == ol.trace_overlap(str(full), direction)


def test_the_peers_section_has_a_row_for_each_training_peer_run():
    """DeepSpeed's rows appear where the peers' JSON has them: a step, or why it did not run."""
    module = build_report()
    runs = module.load()
    peers = runs["peers_bf16"]["peers"]
    zero3 = {"time_ms": 1234.5, "peak_gpu_bytes": 10 * module.GiB, "peak_host_bytes": 47 * module.GiB}
    zero3["deepspeed"] = "0.19.8"
    peers |= {"zero3": zero3, "zero2": {"missing": "DeepSpeed is not installed (no module)"}}
    text = "\n".join(module.peers_section(runs))
    assert "| training step | DeepSpeed ZeRO-3, parameters and optimizer offloaded | 1234.5 | 10.00 | 47.00 |" in text
    assert "| training step | DeepSpeed ZeRO-2, optimizer offloaded |  |  | DeepSpeed is not installed" in text
    assert "DeepSpeed 0.19.8 (`report/peers.py`" in text


def test_the_ablations_table_has_each_acceleration_without_and_with():
    """Each acceleration's step without and with it, from the runs that measure it, and the 11 GiB pairs."""
    module = build_report()

    def run(**steps):
        """A run's JSON with a training step time per mode."""
        return {"results": {mode: {"training": {"time_ms": ms}} for mode, ms in steps.items()}}

    runs = {
        "train_bf16_blocked": run(blocked=600.0),
        "ablation_share_0": run(overlapped=500.0),
        "ablation_share_0.3": run(overlapped=425.0),
        "ablation_share_0_prefetch3": run(overlapped=510.0),
        "train_bf16_overlapped": run(overlapped=450.0),
        "train_bf16_offload_acts": run(overlapped=462.0),
    }
    for i in range(1, module.PAIRS + 1):
        runs[f"budget_ab_streamed_{i}"] = run(overlapped=440.0)
        runs[f"budget_ab_11_{i}"] = run(overlapped=330.0)
        runs[f"budget_ab_11_{i}"]["results"]["overlapped"]["training"] |= {"resident_units": [0, 1, 2], "units": 11}
    text = "\n".join("| " + " | ".join(row) + " |" for row in module.ablation_rows(runs))
    assert "| copies overlapped with compute | off: `--mode blocked` | 600.0 | 450.0 | 0.75 |" in text
    assert "| the GPU's Adam over streamed state | off: `--gpu-adam-share 0` | 500.0 | 425.0 | 0.85 |" in text
    assert (
        "| activation offload, where the saved inputs fit | on: `--offload-activations` | 450.0 | 462.0 | 1.03 |"
        in text
    )
    assert (
        text.count("units resident under an 11 GiB cap (3 of 11)") == module.PAIRS
        and "| 440.0 | 330.0 | 0.75 |" in text
    )


def test_the_disk_tier_note_reads_the_largest_run_and_the_half_on_disk_pair():
    """The largest model with the disk tier, the arithmetic for a disk as large as needed, and 7b-8l half on disk."""
    module = build_report()
    gib = module.GiB
    tier = {"units": 41, "bytes": 62 * gib, "write_gbps": 2.5, "read_gbps": 2.0}
    training = {"time_ms": 64000.0, "bound_ms": 60000.0, "bound_by": "disk", "disk_tier": tier}
    training |= {"disk_bytes": 66.4e9, "disk_gbps": 2.21, "efficiency": 60000.0 / 64000.0}
    training |= {"peak_host_bytes": 114 * gib, "peak_gpu_bytes": 10.5 * gib}
    large = {"layers": 142, "parameters": 29.0e9, "disk_layers": 142, "disk_bytes": 214 * gib, "step_ms": 223000.0}
    found = {"layers": 75, "parameters": 15.44e9, "training": training, "large_disk": large, "limited_by": "the disk"}
    largest = {"run": {"max_gpu_memory": 11}, "find_largest": {"overlapped": found}}
    runs = {"largest_llama7b_disk": largest}
    runs["disk_7b8l_host"] = {"results": {"overlapped": {"training": {"time_ms": 400.0}}}}
    half = {"time_ms": 3700.0, "bound_ms": 3500.0, "bound_by": "disk", "disk_tier": {"bytes": 6 * gib}}
    half["efficiency"] = 3500.0 / 3700.0
    runs["disk_7b8l_half"] = {"results": {"overlapped": {"training": half}}}
    text = "\n".join(module.disk_tier_note(runs))
    assert "75 layers (15.44 B parameters) train under the 11 GiB cap" in text and "efficiency 0.94" in text
    assert "Arithmetic, not measured" in text and "142 layers (29.00 B parameters)" in text and "about 223 s" in text
    assert "66.4 GB each way through the tier's own buffers, at 2.21 GB/s together" in text
    assert "3700.0 ms a step against a bound of 3500.0 ms" in text and "efficiency 0.95" in text
    assert "with all of them in host memory, 400.0 ms" in text


def test_the_readme_and_the_report_stay_small():
    """README.md at most 10 KB; report/ (sources, results, figures and the PDF) at most 5 MB."""
    assert (REPORT.parent / "README.md").stat().st_size <= 10_000
    files = [path for path in REPORT.rglob("*") if path.is_file() and "__pycache__" not in path.parts]
    assert sum(path.stat().st_size for path in files) <= 5_000_000


def test_a_table_is_typeset_within_the_page_width():
    """A table wider than the page gets a smaller font, its headers wrapped to their columns and its widest cells to
    the width left; a narrow one keeps its size; each column is aligned as the rule line says."""
    report = build_report()
    narrow = ["| mode | step (ms) | bound by |", "|---|---:|:---:|", "| overlapped | 394.1 | host_memory |"]
    size, cells, columns, aligns = report.table_layout(narrow, 500)
    assert (
        size == 7.5
        and aligns == ["left", "right", "center"]
        and cells[1] == [["overlapped"], ["394.1"], ["host_memory"]]
    )
    assert sum(columns) < 500
    wide = ["| run | " + " | ".join(f"peak GPU (predicted) of part {i}, GiB" for i in range(8)) + " |"]
    wide += [
        "|---|" + "---:|" * 8,
        "| LLaMA-7B, 64 x 1024 tokens, 11 GiB cap, with every unit streamed | " + "10.18 | " * 8,
    ]
    size, cells, columns, _ = report.table_layout(wide, 500)
    assert 5.0 <= size < 7.5 and sum(columns) <= 500
    assert len(cells[0][1]) > 1 and len(cells[1][0]) > 1  # a header and the widest cell wrapped
