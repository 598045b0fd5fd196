"""--plan: the plan and its predictions, printed without allocating, for this machine or one the flags describe; and
against a CPU run's measured host peak."""

import contextlib
import json

import pytest

import offload_llama as ol
from helpers import cli, machine, run_main

LLAMA_7B_65K = ["--preset", "llama-7b", "--mode", "overlapped", "--train", "--no-inference", "--grad-accum", "16"]
LLAMA_7B_65K += ["--batch-size", "4", "--seq-len", "1024", "--max-gpu-memory", "11"]


GPT2_XL_64K = ["--hidden-size", "1600", "--layers", "48", "--heads", "25", "--kv-heads", "25", "--vocab-size", "50257"]
GPT2_XL_64K += [
    "--intermediate-size",
    "4267",
    "--mode",
    "overlapped",
    "--train",
    "--no-inference",
    "--grad-accum",
    "64",
]
GPT2_XL_64K += ["--batch-size", "1", "--seq-len", "1024", "--max-gpu-memory", "11", "--max-host-memory", "16"]


def test_the_plan_is_printed_without_building_the_model(capsys):
    """For a GPU of 80 GiB, one table that names it, and no model built."""
    code, out, err = run_main(
        capsys, "--plan", "--preset", "tiny", "--mode", "overlapped", "--train", "--gpu-memory", 80
    )
    assert code == 0, err
    assert "a GPU: 80.00 GiB (--gpu-memory's)" in out
    for row in ("| machine |", "| the masters' copy the GPU streams |", "| predicted peak host, a rank |"):
        assert row in out
    assert "| overlapped training: predicted step |" in out and "| overlapped training: runner-up |" in out
    assert "building" not in err and "training state" not in err


@pytest.mark.skipif(ol.torch.cuda.is_available(), reason="plans for this machine's GPU")
def test_a_plan_of_a_gpu_mode_on_a_machine_without_one_says_to_describe_it(capsys):
    """Before, it predicted a GPU peak and a bound for 'a GPU: no GPU' that the same run refused: one line saying to
    give --gpu-memory, nothing printed; a cpu mode's plan needs no GPU."""
    code, out, err = run_main(capsys, "--plan", "--preset", "tiny", "--mode", "cpu,overlapped", "--train")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "--plan: mode overlapped runs on a GPU, and this machine has none: give --gpu-memory GIB" in err
    code, out, err = run_main(capsys, "--plan", "--preset", "tiny", "--mode", "cpu", "--train")
    assert code == 0 and "a GPU: no GPU" in out and "| predicted peak host, a rank |" in out, err


def test_a_machine_the_flags_describe(capsys, tmp_path):
    """LLaMA-7B at 64 x 1024 tokens under 11 GiB on an 80 GiB GPU and 120 GiB of host memory: activation offload on
    (the saved inputs fit the cap no other way), the embeddings and the first layer resident, no unit on the GPU's
    Adam (the compute bounds the step without it), the plan in --json."""
    path = tmp_path / "plan.json"
    code, out, err = run_main(
        capsys, "--plan", *LLAMA_7B_65K, "--gpu-memory", "80", "--host-memory", "120", "--json", path
    )
    assert code == 0, err
    plan = json.loads(path.read_text())["plan"]
    assert plan["facts"]["gpu_bytes"] == 80 * ol.GiB and plan["facts"]["host_bytes"] == 120 * ol.GiB
    assert plan["offload_activations"] and plan["copy_dtype"] == "bfloat16"
    overlapped = plan["modes"]["overlapped"]
    assert overlapped["resident"] == [0, 1] and overlapped["gpu_adam"] == [] and overlapped["training_fits"]
    assert 8.4 * ol.GiB < sum(overlapped["training_gpu"].values()) < 9.4 * ol.GiB  # measured: 8.90 GiB (f_g1_share0)
    assert "| activation offload | on |" in out


def test_segments_where_every_units_inputs_fit_neither_the_gpu_nor_the_host(capsys, tmp_path):
    """GPT2-XL's shape at 64 x 1024 tokens under 11 GiB of GPU and 16 of host on a described H200: with every unit
    keeping its inputs the host is short (they wait there, 9.8 GiB) and the plan is refused, as it is where
    --offload-activations asks for that; else the search finds
    segments that fit both caps, the disk taking the moments the host cannot, and names the runner-up's segments."""
    (tmp_path / "disk").mkdir()
    machine = ["--nvme", tmp_path / "disk", "--gpu-memory", "139.8", "--host-memory", "125"]
    for keeps in (["--segment", "1"], ["--offload-activations"]):  # every unit's inputs kept, on the host
        code, out, err = run_main(capsys, "--plan", *GPT2_XL_64K, *machine, *keeps)
        assert code == 2 and "of host memory" in err, err
        assert "| segments: units a segment, only its first keeping its inputs | 1 |" in out
    path = tmp_path / "plan.json"
    code, out, err = run_main(capsys, "--plan", *GPT2_XL_64K, *machine, "--json", path)
    assert code == 0, err
    plan = json.loads(path.read_text())["plan"]
    overlapped = plan["modes"]["overlapped"]
    assert plan["segment"] > 1 and not plan["offload_activations"] and overlapped["training_fits"]
    assert sum(plan["host"].values()) <= 16 * ol.GiB * (100 - ol.HOST_SLACK) // 100 and 0 < plan["disk_layers"] < 48
    assert sum(overlapped["training_gpu"].values()) <= 11 * ol.GiB - ol.PLAN_MARGIN
    assert overlapped["runner_up"]["segment"] > 1 and overlapped["runner_up"]["step_ms"] >= overlapped["step_ms"]
    segments = ol.segments_text(plan["segment"], plan["remake_segments"])
    assert f"| segments: units a segment, only its first keeping its inputs | {segments} |" in out


def test_units_resident_in_every_mode_hold_no_master_on_the_host(capsys, tmp_path):
    """The units every offloaded mode keeps resident keep their float32 masters on the GPU alone: the host plans no
    master and no compute-dtype copy for them, unless another mode streams them (blocked keeps none resident)."""
    config = ol.llama_config(ol.RunConfig(preset="llama-7b"))
    shards = ol.shard_numels(config, ol.ONE_PROCESS)
    host = {}
    for modes in ("overlapped", "blocked,overlapped"):
        path = tmp_path / f"{modes}.json"
        args = [*LLAMA_7B_65K, "--mode", modes, "--gpu-memory", "80", "--host-memory", "200", "--json", path]
        code, _, err = run_main(capsys, "--plan", *args)
        assert code == 0, err
        host[modes] = json.loads(path.read_text())["plan"]
    resident = host["overlapped"]["modes"]["overlapped"]["resident"]
    assert resident == [0, 1] and host["blocked,overlapped"]["modes"]["blocked"]["resident"] == []
    for modes, streamed in (
        ("overlapped", sum(shards) - sum(shards[u] for u in resident)),
        ("blocked,overlapped", sum(shards)),
    ):
        parts = host[modes]["host"]
        assert parts["float32 masters"] == 4 * streamed and parts["masters' copy"] == 2 * streamed, modes


def test_the_search_weighs_the_host_too(capsys, tmp_path):
    """70 LLaMA-7B layers at 64 x 1024 tokens under a 130 GiB cap, 124.5 GiB of host: keeping the most graphs is the
    fastest on the GPU but leaves the host 37 GiB short; the plan chooses a placement that keeps units resident
    instead, whose state the host then does not hold, and it fits."""
    path = tmp_path / "plan.json"
    args = [
        *LLAMA_7B_65K,
        "--layers",
        "70",
        "--max-gpu-memory",
        "130",
        "--gpu-memory",
        "139.8",
        "--host-memory",
        "124.5",
    ]
    code, _, err = run_main(capsys, "--plan", *args, "--json", path)
    assert code == 0, err
    plan = json.loads(path.read_text())["plan"]
    overlapped = plan["modes"]["overlapped"]
    assert len(overlapped["resident"]) > 10 and overlapped["training_fits"]
    assert sum(plan["host"].values()) <= plan["facts"]["host_bytes"] * (100 - ol.HOST_SLACK) // 100


def test_a_disk_with_room_for_the_segments_moments_is_enough():
    """88 LLaMA-7B layers at 64 x 1024 tokens under a 130 GiB cap on a described H200 with 15 GiB free on the --nvme
    disk: with every unit keeping its inputs on the GPU, 30 units stay resident and the host sends 20 layers' moments
    (30 GiB) to the disk, which has no room for them; segments leave room for more resident units, whose moments stay
    on the GPU, and the plan takes them rather than refuse the run. The disk's room is counted once the resident
    units have settled: with none yet, the first round would count 64 layers' moments."""
    run = ol.RunConfig(mode="overlapped", train=True, inference=False, grad_accum=16, batch_size=4, seq_len=1024)
    run = ol.dataclasses.replace(run, preset="llama-7b", sizes=(("num_hidden_layers", 88),), max_gpu_memory=130)
    run = ol.dataclasses.replace(run, nvme="/nvme")
    config, room = ol.llama_config(run), 15 * ol.GiB
    facts = machine(gpu_gib=139.8, host_gib=119.66, disk_bytes=room, process=ol.PROCESS_BYTES)
    with pytest.raises(ol.UsageError, match="20 layers' 30.2 GiB of Adam moments, 15.2 GiB more than is free there"):
        ol.make_plan(ol.dataclasses.replace(run, segment=1), config, facts)
    plan = ol.make_plan(run, config, facts)
    ol.check_plan(run, config, plan)
    assert plan.segment > 1 and 0 < plan.disk <= room and plan.modes["overlapped"].training_fits
    assert plan.modes["overlapped"].runner_up["disk_layers"] * ol.disk_unit_bytes(config) <= room


def test_segments_are_weighed_where_every_unit_keeping_its_inputs_has_no_disk_room():
    """88 LLaMA-7B layers as above, a 140 GiB host, no room on the disk and copies at 4 GB/s: both plans of every unit
    keeping its inputs are refused for the disk, so no plan is taken unweighed; segments of 2 keep fewer units
    resident than those of 3 and stream more at the slow copies, and the search takes the faster, with a runner-up."""
    run = ol.RunConfig(mode="overlapped", train=True, inference=False, grad_accum=16, batch_size=4, seq_len=1024)
    run = ol.dataclasses.replace(run, preset="llama-7b", sizes=(("num_hidden_layers", 88),), max_gpu_memory=130)
    run = ol.dataclasses.replace(run, nvme="/nvme")
    config = ol.llama_config(run)
    facts = machine(gpu_gib=139.8, host_gib=140, disk_bytes=0, process=ol.PROCESS_BYTES)
    rates = dict(facts.rates) | {"h2d_gbps": 4.0, "d2h_gbps": 4.0}
    facts = ol.dataclasses.replace(facts, rates=tuple(rates.items()))
    plans = {s: ol.segment_plan(ol.dataclasses.replace(run, segment=s), config, facts) for s in (2, 3)}
    assert ol.plan_step_ms(plans[3]) < ol.plan_step_ms(plans[2]) and all(map(ol.plan_fits, plans.values()))
    plan = ol.make_plan(run, config, facts)
    assert plan.segment > 2 and ol.plan_step_ms(plan) <= ol.plan_step_ms(plans[3])
    assert plan.modes["overlapped"].runner_up["step_ms"] >= ol.plan_step_ms(plan)


def test_a_mode_that_does_not_fit_the_gpu_keeps_no_master_there_alone():
    """A mode the plan reports OOM (training does not fit the cap) is never trained: its resident units' masters stay
    on the host, so nothing is allocated on the GPU for it before it is reported."""
    run = ol.RunConfig(preset="7b-8l", mode="gpu,overlapped", train=True, max_gpu_memory=5, resident_layers=8)
    config = ol.llama_config(run)
    plan = ol.make_plan(run, config, machine())
    assert not plan.modes["overlapped"].training_fits and plan.modes["overlapped"].resident
    assert ol.resident_everywhere(run, plan.modes) == set()


def test_a_resume_or_a_save_counts_the_resident_units_host_bytes():
    """The resident units' moments stay untouched on the host, but a resume fills them there first; --save-pretrained
    brings their float32 masters back to the host together."""
    config = ol.llama_config(ol.RunConfig(preset="7b-8l"))
    shards = ol.shard_numels(config, ol.ONE_PROCESS)
    resident = {0, 1, 2}

    def host(**flags) -> dict:
        run = ol.RunConfig(preset="7b-8l", mode="overlapped", train=True, **flags)
        return ol.host_parts(run, config, machine(), None, 2, resident)

    plain = host()
    assert host(resume="folder")["Adam moments"] - plain["Adam moments"] == 8 * sum(shards[u] for u in resident)
    assert host(save_pretrained="folder")["resident masters saved"] == 4 * sum(shards[u] for u in resident)
    assert "resident masters saved" not in plain


def test_a_placement_that_fits_the_gpu_comes_first_where_none_fits_the_host():
    """With --resident-layers every placement keeps the same units resident, so the host fits all or none: where none,
    the one that fits the GPU is still chosen before a faster one that does not."""
    run = ol.RunConfig(
        preset="7b-8l", mode="overlapped", train=True, max_gpu_memory=20, resident_layers=2, grad_accum=4
    )
    plan = ol.make_plan(run, ol.llama_config(run), machine(host_gib=8))
    assert plan.modes["overlapped"].training_fits


def test_a_plan_that_will_not_fit_is_printed_then_refused(capsys):
    """The table first, so the user sees where the bytes go; then check_plan's one line, exit 2."""
    code, out, err = run_main(capsys, "--plan", *LLAMA_7B_65K, "--gpu-memory", "80", "--host-memory", "60")
    assert code == 2 and "| predicted peak host, a rank |" in out
    assert err.strip().splitlines()[-1].startswith("offload_llama.py: error: the run needs ") and "host memory" in err


def test_the_machine_flags_need_the_plan(capsys):
    for args, message in (
        (["--gpu-memory", "80"], "--gpu-memory does nothing without --plan: add --plan"),
        (["--plan", "--rate", "h2d=fast"], "--rate: 'h2d=fast': give NAME=VALUE"),
        (["--plan", "--rate", "gpu_tflops=1e-300"], "VALUE from 0.001 to 1e6"),
        (["--plan", "--gpu-memory", "1e30"], "--gpu-memory must be at most 1,048,576"),
        (["--plan", "--rank-timeout", "0.5"], "--rank-timeout must be at least 1 second"),
        (["--plan", "--gpus", "0"], "--gpus must be at least 1"),
        (["--plan", "--rank-timeout", "0"], "--rank-timeout must be a positive number of seconds"),
        (["--plan", "--gpus", "2", "--mode", "gpu"], "--mode gpu: 2 ranks run an offloaded mode"),
        (["--plan", "--gpus", "3", "--mode", "overlapped", "--train"], "split evenly over the 3 ranks"),
    ):
        code, _, err = run_main(capsys, *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_plan_under_torchrun_is_refused(monkeypatch, capsys):
    """Each rank would print a plan of its own: --plan runs once, without torchrun, --gpus saying how many ranks."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    code, _, err = run_main(capsys, "--plan", "--mode", "overlapped")
    assert code == 2 and "--plan describes a run without starting one: run it once, without torchrun" in err


def test_rates_and_ranks_change_the_predictions_not_the_bytes(capsys, tmp_path):
    """--rate h2d_gbps=27.5 doubles the predicted H2D part; --gpus 2 halves a rank's masters, and its inference holds
    half of every layer beside the model."""
    plans = {}
    for name, extra in {
        "h100": [],
        "slow": ["--rate", "h2d_gbps=27.5"],
        "two": ["--gpus", "2", "--grad-accum", "2"],
    }.items():
        path = tmp_path / f"{name}.json"
        machine = ["--gpu-memory", "80", "--host-memory", "120"]
        code, _, err = run_main(capsys, "--plan", "--mode", "overlapped", "--train", *machine, *extra, "--json", path)
        assert code == 0, err
        plans[name] = json.loads(path.read_text())["plan"]
    h2d = {name: plan["modes"]["overlapped"]["bound_ms"]["h2d_ms"] for name, plan in plans.items()}
    assert abs(h2d["slow"] - 2 * h2d["h100"]) < 1e-6 * h2d["h100"]
    masters = {name: plan["host"]["float32 masters"] for name, plan in plans.items()}
    assert abs(masters["two"] - masters["h100"] / 2) < 4 * ol.ALIGN * 11 and plans["two"]["facts"]["world"] == 2
    config = ol.llama_config(ol.RunConfig(dtype="bfloat16"))  # the 7b-8l preset the plans are of
    layers = 2 * config.num_hidden_layers * ol.model_units(config)[1].layout.numel  # bfloat16, every layer whole
    assert "inference shards" not in plans["h100"]["host"]  # one process streams from the model's own layers
    assert abs(plans["two"]["host"]["inference shards"] - layers / 2) <= 2 * config.num_hidden_layers * ol.ALIGN


@pytest.mark.slow  # a run of its own: 15 s
def test_the_plan_predicts_a_cpu_runs_host_peak(tmp_path):
    """A cpu-mode training run of a 42M-parameter model: its measured peak resident set is the plan's within 8% (the
    plan counts the process as it is when planning, the model, its copy, masters, gradients and moments, and the
    traced step; it leaves out what torch's fused Adam and the allocator take besides: 5.6 to 7.3% of the peak)."""
    path = tmp_path / "r.json"
    sizes = ["--hidden-size", "512", "--intermediate-size", "1408", "--layers", "8", "--vocab-size", "16384"]
    r = cli(
        "--preset",
        "tiny",
        *sizes,
        "--heads",
        "8",
        "--kv-heads",
        "8",
        "--mode",
        "cpu",
        "--train",
        "--steps",
        "2",
        "--seq-len",
        "128",
        "--dtype",
        "float32",
        "--json",
        path,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(path.read_text())
    predicted, measured = sum(report["plan"]["host"].values()), report["peak_host_bytes_process"]
    assert abs(predicted - measured) <= 0.08 * measured, (predicted, measured, report["plan"]["host"])


def test_a_plan_allocates_nothing_the_size_of_the_run(capsys):
    """Eager attention over a million tokens, whose mask alone would take terabytes: the plan traces its passes on the
    meta device (HF's layer arguments computed for 5 tokens, then grown), prints and refuses it in one line."""
    args = ["--attention", "eager", "--seq-len", "1000000", "--mode", "overlapped", "--train", "--gpu-memory", "80"]
    code, out, err = run_main(capsys, "--plan", *args)
    assert code == 2 and "| overlapped training: peak GPU |" in out and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("offload_llama.py: error: mode overlapped needs at least")


def test_ranks_plan_their_share_of_the_step(capsys):
    """--gpus 8 and 512 micro-batches a step: a rank's 64 fit its GPU, as one process's 64 do; their inference streams
    every layer (each rank copies its eighth), none resident, and each holds its shards beside the model."""
    machine = ["--gpu-memory", "80", "--host-memory", "2000"]
    code, out, err = run_main(
        capsys, "--plan", "--mode", "overlapped", "--train", "--grad-accum", "512", "--gpus", "8", *machine
    )
    assert code == 0, err
    assert "| overlapped training: peak GPU |" in out
    assert "| overlapped inference | resident decoder layers: none;" in out and "inference shards" in out


def test_unit_names_join_each_run_of_layers_and_name_every_other_unit():
    """The plan's names of a set of units: each run of consecutive decoder layers joined, so a gap shows (the disk
    tier's spread layers leave gaps in the GPU Adam's), the norm named as the head is."""
    units = ol.model_units(ol.llama_config(ol.RunConfig(preset="7b-8l")))  # embeddings, layers 1 to 8, norm, head
    assert ol.unit_names(units, (0, 1, 3)) == "model.embed_tokens, model.layers.0, model.layers.2"
    assert ol.unit_names(units, range(11)) == "model.embed_tokens, model.layers.0-7, model.norm, lm_head"
    assert ol.unit_names(units, (8, 2, 3)) == "model.layers.1-2, model.layers.7" and ol.unit_names(units, ()) == "none"


def test_segments_cost_the_plan_memory_not_compute():
    """A segment's backward runs its units micro-batch by micro-batch, no forward twice: 88 LLaMA-7B layers' predicted
    GPU compute is the same in segments of 1 and 3. What segments cost is memory: at each segment's last unit a
    micro-batch's graphs of the others and their gradients of micro-batch 0 (waiting for 1's), a slot and a gradient
    buffer for each of its units; what they save is the inputs of all but the segments' first units."""
    run = ol.RunConfig(mode="overlapped", train=True, inference=False, grad_accum=16, batch_size=4, seq_len=1024)
    run = ol.dataclasses.replace(run, preset="llama-7b", sizes=(("num_hidden_layers", 88),))
    config, facts = ol.llama_config(run), machine(gpu_gib=139.8, host_gib=124.8, process=ol.PROCESS_BYTES)
    runs = {s: ol.dataclasses.replace(run, segment=s) for s in (1, 3)}
    bounds = {s: ol.predicted_bound(r, config, facts, 1, range(20), (), None) for s, r in runs.items()}
    assert bounds[3]["gpu_compute_ms"] == bounds[1]["gpu_compute_ms"]
    kinds = [unit.kind for unit in ol.model_units(config)]
    extra = ol.segment_bytes(runs[3], config, facts, kinds)
    assert sorted(extra) == [*range(2, 90, 3), 90]  # each segment's last unit, the head alone
    graph = ol.traced_passes(ol.trace_key(runs[3], config), "layer", 1, True)[2]
    assert graph > 0 and extra[5] == 2 * (graph + 2 * ol.model_units(config)[1].layout.numel)  # micro-batch 0's
    parts = {s: ol.training_parts(r, config, facts, 1, True, (), (), ol.torch.bfloat16) for s, r in runs.items()}
    assert parts[3]["gradient buffer"] == 3 * parts[1]["gradient buffer"]
    assert parts[3]["slots"] == 3 * parts[1]["slots"]  # 3 ahead and 3 held, against 1 and 1
    unplaced = {s: ol.unplaced_bytes(r, config, facts) for s, r in runs.items()}
    assert unplaced[3]["saved inputs"] <= unplaced[1]["saved inputs"] / 3 + 2 * ol.unit_inputs_bytes(run, config)
    assert unplaced[3]["working set"] > unplaced[1]["working set"]


def test_a_cap_the_margin_takes_whole_says_so(capsys):
    """Under a 0.5 GiB cap the plan's margin for the allocator's fragmentation leaves nothing: the table and the
    note say that what does not fit is the cap less that margin, not the cap."""
    code, out, err = run_main(
        capsys,
        "--plan",
        "--preset",
        "tiny",
        "--mode",
        "overlapped",
        "--train",
        "--gpu-memory",
        80,
        "--max-gpu-memory",
        0.5,
    )
    limit = "the --max-gpu-memory cap of 0.5 GiB less the plan's 0.50 GiB for the allocator's fragmentation"
    assert code == 0, err
    assert f"(does not fit {limit})" in out and f"training does not fit {limit}: a run reports it OOM" in err


def test_the_plan_weighs_segments_remade_against_a_micro_batch_at_a_time():
    """The two ways of a backward in segments trade GPU compute for GPU memory, and the search weighs both at each
    length. 88 LLaMA-7B layers at 64 x 1024 tokens under 130 GiB on a described H200 take segments a micro-batch at a
    time: no forward runs twice, faster than the fastest remade. 104 with --nvme and 119 GiB of host take segments
    remade: their smaller GPU peak leaves room for more resident units and fewer layers' moments on the disk, whose
    traffic bounds the step."""
    run = ol.RunConfig(mode="overlapped", train=True, inference=False, grad_accum=16, batch_size=4, seq_len=1024)
    run = ol.dataclasses.replace(run, preset="llama-7b", max_gpu_memory=130)
    for layers, host, disk, remade in ((88, 124.8, None, False), (104, 118.9, 60 * ol.GiB, True)):
        layered = ol.dataclasses.replace(run, sizes=(("num_hidden_layers", layers),), nvme=disk and "/nvme")
        config = ol.llama_config(layered)
        facts = machine(gpu_gib=139.8, host_gib=host, disk_bytes=disk, process=ol.PROCESS_BYTES)
        plan = ol.make_plan(layered, config, facts)
        assert plan.segment > 1 and plan.remake_segments == remade and ol.plan_fits(plan), layers
        others = []  # the other way's plans at each length that the disk has room for
        for n in ol.SEGMENTS:
            with contextlib.suppress(ol.DiskShort):
                others.append(
                    ol.segment_plan(
                        ol.dataclasses.replace(layered, segment=n, remake_segments=not remade), config, facts
                    )
                )
        other = min((p for p in others if ol.plan_fits(p)), key=ol.plan_step_ms)
        assert ol.plan_step_ms(plan) < ol.plan_step_ms(other), layers
        if remade:
            assert plan.disk_layers < other.disk_layers
