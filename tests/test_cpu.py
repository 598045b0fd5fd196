"""CPU tier: the offload logic with the CPU as compute device, the CLI contracts, and bad input."""

import json

import pytest
import torch

import offload_llama as ol
from helpers import build, cli, resident_logits, run_main, streamed_logits, tiny_run

CONFIGS = {
    "gqa-3-layers": {},  # the tiny preset: 4 heads over 2 KV heads, 3 layers
    "one-layer": {"num_hidden_layers": 1},
    "mha-5-layers": {"num_hidden_layers": 5, "num_key_value_heads": 4},
}


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("name", CONFIGS)
def test_streamed_logits_equal_plain_model(name, depth):
    model, ids = build(tiny_run(**CONFIGS[name]))
    expected = resident_logits(model, ids, "cpu")
    assert torch.equal(streamed_logits(model, ids, "cpu", depth), expected)


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 5])
def test_each_pass_copies_every_layer_once_in_order(depth):
    model, ids = build(tiny_run(num_hidden_layers=4))
    copies = []

    def count_copies(streamer):
        prefetch = streamer.prefetch
        streamer.prefetch = lambda i: (copies.append(i), prefetch(i))

    streamed_logits(model, ids, "cpu", depth, streamer_hook=count_copies)
    assert copies == [0, 1, 2, 3]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_copy_whose_source_is_not_ready_lets_the_ready_ones_go_first(depth):
    """Layer 1's source is not ready until it is about to run (training: its CPU update still runs): the copies
    behind it in the window go first, into the ring's other slots, and the logits do not change."""
    model, ids = build(tiny_run(num_hidden_layers=4))
    copies = []

    def layer_1_late(streamer):
        prefetch = streamer.prefetch
        streamer.prefetch = lambda p: (copies.append(streamer.window.units[p]), prefetch(p))
        streamer.writer.written = lambda u: u != 1

    logits = streamed_logits(model, ids, "cpu", depth, streamer_hook=layer_1_late)
    assert torch.equal(logits, resident_logits(model, ids, "cpu"))
    assert copies == ([0, 2, 1, 3] if depth == 1 else [0, 2, 3, 1])


def test_stale_slot_is_caught():
    """Negative control: a streamer that stops copying after the first layer must give other logits."""
    model, ids = build(tiny_run())
    expected = resident_logits(model, ids, "cpu")

    def copy_only_layer_0(streamer):
        for buffer in streamer.buffers:  # what the slots held before: never the layers' weights by chance
            buffer.fill_(float("nan"))
        prefetch = streamer.prefetch
        streamer.prefetch = lambda i: prefetch(i) if i == 0 else None

    assert not torch.equal(streamed_logits(model, ids, "cpu", 2, streamer_hook=copy_only_layer_0), expected)


def test_random_init_is_hf_llama_init_and_independent_of_thread_count(monkeypatch):
    run = tiny_run()
    model, _ = build(run)
    monkeypatch.setattr(ol.os, "cpu_count", lambda: 1)
    again, _ = build(run)
    std = model.config.initializer_range
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=False):
        assert torch.equal(p, q), name
        if p.dim() == 1:
            assert torch.all(p == 1), name
        else:
            assert abs(p.float().std().item() - std) < 0.1 * std, name
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)


@pytest.mark.parametrize("ranks", [ol.Ranks(), ol.Ranks(1, 3, 1, 3)])
def test_drawing_into_the_masters_gives_the_whole_draw(ranks, monkeypatch):
    """A lean run draws the random model straight into its masters (a rank: into its shards, which cut weights and
    their chunks apart): the whole model's draw rounded to its dtype, bit for bit (the pad row zeroed too), and no
    CPU model is built. Chunks of 1000 elements, so that weights and shards span several."""
    monkeypatch.setattr(ol, "DRAW_CHUNK", 1000)
    run = ol.RunConfig(preset="tiny", mode="overlapped", train=True, inference=False, dtype="bfloat16", seq_len=32)
    run = ol.dataclasses.replace(run, sizes=(("vocab_size", 300),))
    assert ol.draws_units(run) and not ol.draws_units(ol.dataclasses.replace(run, fwd_bwd_reference=True))
    config = ol.llama_config(run)
    config.pad_token_id = 7
    whole = ol.load_model(ol.dataclasses.replace(run, inference=True), config)
    lazy = ol.load_model(run, config)
    assert all(p.device.type == "meta" for p in lazy.parameters())
    units = ol.model_units(config)
    dtypes = {"grad_dtype": torch.bfloat16, "copy_dtype": torch.bfloat16}
    store = ol.OffloadedAdam(units, run.adam, pin=False, **dtypes, ranks=ranks)
    ol.draw_masters(store, lazy, run.seed)
    store.load(None)
    assert all(p.device.type == "meta" for p in lazy.parameters())
    expected = ol.OffloadedAdam(units, run.adam, pin=False, **dtypes)
    expected.load(whole)
    for got, whole_flat in zip(store.masters, expected.masters, strict=True):
        start = ranks.rank * got.numel()
        n = max(0, min(got.numel(), whole_flat.numel() - start))  # the last shard runs past the padded unit
        assert torch.equal(got[:n], whole_flat[start : start + n])
    assert torch.all(whole.model.embed_tokens.weight[7] == 0)


def test_store_holds_the_only_host_copy():
    model, _ = build(tiny_run())
    store = ol.ParamStore(model, pin=False)
    for layer, flat in zip(model.model.layers, store.flats, strict=False):
        for p in layer.parameters():
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert store.layout.offsets == tuple(sorted(store.layout.offsets))
    assert all(off % ol.ALIGN == 0 for off in store.layout.offsets)


def test_cli_cpu_json_and_saved_output(tmp_path):
    out_json, out_pt = tmp_path / "r.json", tmp_path / "o.pt"
    r = cli(
        "--mode",
        "cpu",
        "--preset",
        "tiny",
        "--batch-size",
        2,
        "--seq-len",
        48,
        "--json",
        out_json,
        "--save-output",
        out_pt,
    )
    assert r.returncode == 0, r.stderr
    assert "| cpu | " in r.stdout and "Table 2" in r.stdout
    report = json.loads(out_json.read_text())
    assert report["results"]["cpu"]["inference"]["time_ms"] > 0
    assert report["config"]["num_key_value_heads"] == 2 and report["tokens"] == 96
    assert {"device", "torch", "transformers", "parameters", "layer_bytes"} <= report.keys()
    saved = torch.load(out_pt)
    model, ids = build(tiny_run())  # the same preset and seed rebuild the same weights and inputs
    assert torch.equal(saved["input_ids"], ids)
    assert torch.equal(saved["logits"]["cpu"], resident_logits(model, ids, "cpu"))


def test_cli_loads_a_save_pretrained_folder(tmp_path):
    model, ids = build(tiny_run(num_hidden_layers=2))
    model.save_pretrained(tmp_path / "m")
    r = cli(
        "--mode",
        "cpu",
        "--model",
        tmp_path / "m",
        "--batch-size",
        2,
        "--seq-len",
        48,
        "--save-output",
        tmp_path / "o.pt",
    )
    assert r.returncode == 0, r.stderr
    assert "Loading weights" not in r.stderr  # transformers' bar stays out of the progress lines
    assert torch.equal(torch.load(tmp_path / "o.pt")["logits"]["cpu"], resident_logits(model, ids, "cpu"))


def write_config(folder, **fields):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


BAD_INPUT = {
    "hidden not divisible by heads": (["--preset", "tiny", "--hidden-size", 66], "not divisible by 4 attention heads"),
    "zero layers": (["--preset", "tiny", "--layers", 0], "--layers must be at least 1"),
    "missing folder": (["--model", "/no/such/folder"], "no such folder"),
    "a path with a line break": (["--model", "/no/such\nfolder"], "/no/such\\nfolder"),
    "a path with an escape sequence": (["--model", "/no/\x1b[2Jsuch"], "/no/\\x1b[2Jsuch"),
    "folder without config": (["--model", "{tmp}"], "no config.json"),
    "not a llama folder": (["--model", "{gpt2}"], "model_type is 'gpt2', not 'llama'"),
    "negative hidden size in config.json": (["--model", "{negative}"], "config.json"),  # transformers' message, or ours
    "Infinity in config.json": (["--model", "{infinite}"], "config.json is not valid JSON (Infinity is not a JSON"),
    "config.json nested too deeply": (["--model", "{deep}"], "config.json is not valid JSON (nested too deeply)"),
    "a 5,000-digit number in config.json": (["--model", "{huge}"], "config.json is not valid JSON (Exceeds the limit"),
    "1e999 in config.json": (
        ["--model", "{beyond}"],
        "config.json is not valid JSON (1e999 is beyond a float's range)",
    ),
    "an activation transformers lacks": (["--model", "{evil}"], "transformers rejects its config.json (KeyError"),
    "cap below one layer": (
        ["--preset", "tiny", "--mode", "gpu", "--max-gpu-memory", 1e-5],
        "less than one decoder layer",
    ),
    "bad mode": (["--mode", "fast"], "choose all, or one or more of"),
    "zero prefetch": (["--prefetch", 0], "--prefetch must be at least 1"),
    "negative resident layers": (["--resident-layers", -1], "--resident-layers must be at least 0"),
    "more resident layers than the model has": (
        ["--preset", "tiny", "--mode", "overlapped", "--resident-layers", 4],
        "--resident-layers 4: the model has 3 decoder layers",
    ),
    "resident layers without overlapped": (
        ["--preset", "tiny", "--mode", "cpu", "--resident-layers", 1],
        "add overlapped to --mode",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    gpt2 = write_config(tmp_path / "gpt2", model_type="gpt2")
    negative = write_config(tmp_path / "negative", model_type="llama", hidden_size=-3)
    damaged = {"infinite": '{"model_type": "llama", "rms_norm_eps": Infinity}', "deep": "[" * 10**5 + "]" * 10**5}
    damaged["huge"] = '{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}"
    damaged["beyond"] = '{"model_type": "llama", "rms_norm_eps": 1e999}'
    damaged["evil"] = json.dumps(ol.llama_config(ol.RunConfig(preset="tiny")).to_dict() | {"hidden_act": "evil"})
    folders = {"tmp": tmp_path, "gpt2": gpt2, "negative": negative}
    for name, text in damaged.items():
        folders[name] = write_config(tmp_path / name)
        (folders[name] / "config.json").write_text(text)
    args, message = BAD_INPUT[case]
    code, out, err = run_main(capsys, *[str(a).format(**folders) for a in args])
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_mode_without_cuda_exits_2():
    r = cli("--mode", "overlapped", "--preset", "tiny")  # a process of its own: the whole way, traceback or not
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert f"a first try: {ol.FIRST_CONTACT}" in r.stderr  # the README's command without a GPU


def test_dtype_the_gpu_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    run = ol.RunConfig(mode="overlapped", preset="tiny", dtype="bfloat16")
    with pytest.raises(ol.UsageError, match="Tesla V100 cannot compute in bfloat16"):
        ol.check_devices(run, ol.llama_config(run))
    assert ol.default_dtype() == "float16"


def test_pipeline_bound():
    every = [True] * 8
    # copy-bound: every copy is on the critical path, plus the last layer's compute
    assert ol.pipeline_bound_ms(every, copy_ms=7.0, compute_ms=4.0, resident_ms=2.0, depth=1) == 2 + 7 + 7 * 7 + 4
    # compute-bound: every layer's compute, plus the first copy
    assert ol.pipeline_bound_ms(every, copy_ms=3.0, compute_ms=5.0, resident_ms=2.0, depth=2) == 2 + 3 + 7 * 5 + 5
    # blocked: nothing overlaps
    assert ol.pipeline_bound_ms(every, copy_ms=3.0, compute_ms=5.0, resident_ms=2.0, depth=0) == 2 + 8 * 8
    # resident layers 0, 2, 4, 6: layer 1 waits for its copy (7 ms, under layer 0's 4), then every later copy hides
    # under two layers' compute
    spread = [False, True] * 4
    assert ol.pipeline_bound_ms(spread, copy_ms=7.0, compute_ms=4.0, resident_ms=2.0, depth=1) == 2 + 7 + 7 * 4
    # the same four resident at the end: the four copies come first, then most of the compute
    assert ol.pipeline_bound_ms([True] * 4 + [False] * 4, 7.0, 4.0, 2.0, 1) == 2 + 4 * 7 + 5 * 4
    assert ol.pipeline_bound_ms([True] * 4 + [False] * 4, 7.0, 4.0, 2.0, 0) == 2 + 4 * 7 + 8 * 4


def test_trace_overlap_counts_copy_time_under_kernels_of_other_streams(tmp_path):
    def event(cat, name, ts, dur, stream):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {
        "traceEvents": [
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 10, 20),
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 30, 10, 20),
            event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 50, 7),  # not host-to-device: ignored
            event("kernel", "gemm", 5, 10, 7),  # covers copy 1 from 5 to 10
            event("kernel", "gemm", 6, 2, 7),  # nested in the last: counted once
            event("kernel", "gemm", 32, 3, 20),  # same stream as the copy: not overlap
            event("kernel", "gemm", 38, 10, 7),  # covers copy 2 from 38 to 40
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 45, 10, 20),  # 3 of it before stream 7's end, at 48
        ]
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    t = ol.trace_overlap(str(path))
    assert t["copy_ms"] == pytest.approx(0.030) and t["overlap_ms"] == pytest.approx(0.010)
    assert t["hideable_ms"] == pytest.approx(0.023)  # all of copies 1 and 2, and copy 3's first 3
    assert t["copy_streams"] == [20] and t["kernel_streams"] == [7, 20]
