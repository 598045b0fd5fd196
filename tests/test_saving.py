"""Saving and resuming training on the CPU: the Hugging Face folder round trip, a resumed run equal to one run bit
for bit, a writer killed mid-checkpoint, and the refused paths."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import LlamaForCausalLM

import offload_llama as ol
from helpers import (
    SCRIPT,
    assert_same_checkpoint,
    build,
    checkpoint_state,
    cli,
    machine,
    offloaded_trainer,
    run_main,
    tiny_run,
)

TRAIN = ["--preset", "tiny", "--seq-len", "32", "--mode", "cpu", "--train", "--no-inference"]


def test_save_pretrained_round_trip(tmp_path):
    """from_pretrained loads the folder as the trained float32 masters, bit for bit, and --model goes on from it."""
    folder, out = tmp_path / "hf", tmp_path / "out.pt"
    r = cli(*TRAIN, "--steps", "3", "--save-pretrained", folder, "--save-output", out)
    assert r.returncode == 0, r.stderr
    assert f"trained float32 weights saved to {folder}" in r.stderr and "Writing model shards" not in r.stderr
    masters = torch.load(out)["training"]["cpu"]["masters"]
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the shards as the config files: as the umask gives new files
    loaded = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert loaded.keys() == masters.keys()
    assert all(torch.equal(loaded[name], t) for name, t in masters.items())
    r = cli("--model", folder, "--seq-len", "32", "--mode", "cpu", "--train", "--no-inference", "--steps", "1")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_resumed_run_equals_one_run(tmp_path):
    """6 steps in one run, against 3 (a checkpoint after 2 and 3) and then 3 more in a new process that resumes (after
    4, as every 2 counts from the first step, and 6)."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli(*TRAIN, "--steps", "6", "--checkpoint", one).returncode == 0
    r = cli(*TRAIN, "--steps", "3", "--checkpoint", two, "--checkpoint-every", "2")
    assert r.returncode == 0 and "checkpoint after step 2" in r.stderr, r.stderr
    r = cli(*TRAIN, "--steps", "3", "--resume", two, "--checkpoint", two, "--checkpoint-every", "2")
    assert r.returncode == 0 and f"resumed from {two} after step 3" in r.stderr, r.stderr
    assert "checkpoint after step 4" in r.stderr and "checkpoint after step 5" not in r.stderr  # counted from step 1
    assert "  step 4: loss" in r.stderr and "  step 1: loss" not in r.stderr  # the log goes on counting
    assert_same_checkpoint(one, two)
    assert sorted(p.name for p in two.iterdir()) == sorted([ol.CHECKPOINT_FILE, *checkpoint_state(two)[0]["files"]])


@pytest.mark.slow
def test_killed_writer_leaves_the_last_checkpoint_whole(tmp_path):
    """SIGKILL while a checkpoint is written: the one before is whole, and resuming from it gives the uninterrupted
    run's state bit for bit."""
    sizes = ["--hidden-size", "512", "--intermediate-size", "1408", "--layers", "2", "--heads", "8", "--kv-heads", "8"]
    train = [*TRAIN, *sizes, "--seq-len", "16"]
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    args = [*train, "--steps", "200", "--checkpoint", killed, "--checkpoint-every", "1"]
    writer = subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], stderr=subprocess.DEVNULL)
    try:
        while writer.poll() is None:  # until a checkpoint is whole and the next one is being written
            if (killed / ol.CHECKPOINT_FILE).exists() and any(killed.glob(".unit*.tmp")):
                writer.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)  # a unit file takes far longer to write: the poll leaves the writer the cores
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL, "the writer ended before it was killed"
    steps = checkpoint_state(killed)[0]["steps"]
    assert steps >= 1
    r = cli(*train, "--steps", "2", "--resume", killed, "--checkpoint", killed)
    assert r.returncode == 0, r.stderr
    assert cli(*train, "--steps", str(steps + 2), "--checkpoint", straight).returncode == 0
    assert_same_checkpoint(killed, straight)
    assert not list(killed.glob(".*.tmp"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny cpu-mode checkpoint after one step."""
    folder = tmp_path_factory.mktemp("saved")
    r = cli(*TRAIN, "--steps", "1", "--checkpoint", folder)
    assert r.returncode == 0, r.stderr
    return folder


def test_a_first_checkpoint_killed_before_its_record_is_replaced_by_the_next_run(checkpoint, tmp_path):
    """What a SIGKILL in the first write leaves (unit files, a temporary one, no record) does not block the rerun,
    which writes its checkpoint over it; a file of another kind there still does."""
    killed = tmp_path / "killed"
    killed.mkdir()
    for unit in checkpoint.glob("unit*.pt"):
        shutil.copy(unit, killed / unit.name)
    (killed / ".unit004.step1.pt.4613.tmp").write_bytes(b"cut short")
    r = cli(*TRAIN, "--steps", "1", "--checkpoint", killed)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in killed.iterdir()) == sorted(
        [ol.CHECKPOINT_FILE, *checkpoint_state(killed)[0]["files"]]
    )
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "unit000.step1.pt").write_bytes(b"x")
    (tmp_path / "mixed" / "notes.txt").write_text("mine")
    r = cli(*TRAIN, "--steps", "1", "--checkpoint", tmp_path / "mixed")
    assert r.returncode == 2 and "holds notes.txt (a file), which a checkpoint does not" in r.stderr, r.stderr


def test_a_checkpoint_folder_takes_and_removes_only_what_a_write_makes(tmp_path):
    """Only regular files named as a write names its files (and its tokenizer's folder aside) are taken as a killed
    first write's, or removed as unnamed: the user's look-alikes and folders stay, and refuse a first write."""
    for name, kind in {
        "unit000.step1.pt": "folder",
        ".tokenizer.backup.tmp": "folder",
        ".unit000.step5.pt": "file",
    }.items():
        folder = tmp_path / name.strip(".")
        folder.mkdir()
        (folder / name).mkdir() if kind == "folder" else (folder / name).write_bytes(b"mine")
        with pytest.raises(ol.UsageError, match=rf"holds {re.escape(name)} \(a {kind}\), which a checkpoint does not"):
            ol.check_checkpoint_folder(folder)
    killed = tmp_path / "killed"
    killed.mkdir()
    for name in ("unit000.step1.pt", "tokenizer.json", ".checkpoint.json.77.tmp"):
        (killed / name).write_bytes(b"x")
    (killed / ".tokenizer.a1b2c3d4.tmp").mkdir()
    ol.check_checkpoint_folder(killed)  # taken: the next write replaces it
    (tmp_path / "tokenizer_only").mkdir()
    (tmp_path / "tokenizer_only" / "tokenizer.json").write_text("{}")  # the user's: no unit file beside it
    with pytest.raises(ol.UsageError, match="holds files and no checkpoint.json"):
        ol.check_checkpoint_folder(tmp_path / "tokenizer_only")
    kept = ["unit-notes.pt", "tokenizer_mine.json", "README.txt"]
    for name in kept:
        (killed / name).write_text("mine")
    (killed / "unit_runs.pt").mkdir()
    (killed / ol.CHECKPOINT_FILE).write_text(json.dumps({"files": ["unit000.step1.pt"]}))
    ol.remove_unnamed(killed)
    assert sorted(p.name for p in killed.iterdir()) == sorted(
        [*kept, "unit_runs.pt", ol.CHECKPOINT_FILE, "unit000.step1.pt"]
    )


def test_a_checkpoint_counts_the_tokens_its_state_trained_on(checkpoint, tmp_path):
    """A resumed run with longer sequences counts on from the checkpoint's tokens, not its steps at the new shape."""
    first = json.loads((checkpoint / ol.CHECKPOINT_FILE).read_text())
    assert first["tokens"] == first["steps"] * first["grad_accum"] * first["batch_size"] * 32
    args = ["--seq-len", "64", "--steps", "1", "--resume", checkpoint, "--checkpoint", tmp_path / "longer"]
    r = cli(*[a for a in TRAIN if a not in ("--seq-len", "32")], *args)
    assert r.returncode == 0, r.stderr
    tokens = first["tokens"] + first["grad_accum"] * first["batch_size"] * 64
    assert f"{tokens:,} tokens seen" in r.stderr
    assert json.loads((tmp_path / "longer" / ol.CHECKPOINT_FILE).read_text())["tokens"] == tokens


def test_a_second_run_on_a_checkpoint_folder_in_use_is_refused(checkpoint, tmp_path):
    """Two runs given one --checkpoint folder would blend their unit files, and a run resuming from a folder another
    writes would read it as it is replaced: the folder is locked while a run writes it (shared while one resumes
    from it), and a folder made only for the lock goes again with it."""
    held = tmp_path / "held"
    run = ol.RunConfig(preset="tiny", mode="cpu", train=True, checkpoint=str(held))
    ol.hold_checkpoint_folders(run)
    try:
        r = cli(*TRAIN, "--steps", "1", "--checkpoint", held)
        assert r.returncode == 2 and f"--checkpoint {held} is in use by another run" in r.stderr, r.stderr
    finally:
        ol.release_checkpoint_folders()
    reading = ol.dataclasses.replace(run, checkpoint=None, resume=str(checkpoint))
    ol.hold_checkpoint_folders(reading)
    try:
        r = cli(*TRAIN, "--steps", "1", "--resume", checkpoint, "--checkpoint", checkpoint)
        assert r.returncode == 2 and f"--checkpoint {checkpoint} is in use by another run" in r.stderr, r.stderr
        assert cli(*TRAIN, "--steps", "1", "--resume", checkpoint, "--checkpoint", tmp_path / "other").returncode == 0
    finally:
        ol.release_checkpoint_folders()
    assert not held.exists() and ol.HELD_FOLDERS == []
    two = ol.dataclasses.replace(run, mode="cpu,gpu")
    ol.hold_checkpoint_folders(two)
    assert [folder.name for _, folder, _ in ol.HELD_FOLDERS] == ["held", *two.modes]  # the given folder goes last
    ol.release_checkpoint_folders()
    assert not held.exists()


@pytest.mark.slow
def test_a_resume_beside_a_run_rewriting_the_checkpoint_never_refuses_a_whole_one(checkpoint, tmp_path, capsys):
    """One run goes on from a folder into it, a checkpoint every step; meanwhile another resumes from the folder, 100
    times: each is refused at once as the folder is in use, never for a checkpoint it read as the writer replaced it
    (before, 1 in 4 read it first, then took the lock, and said 'unit003.step184.pt does not load')."""
    folder = tmp_path / "ck"
    shutil.copytree(checkpoint, folder)
    args = [*TRAIN, "--steps", "100000", "--resume", folder, "--checkpoint", folder, "--checkpoint-every", "1"]
    writer = subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], stderr=subprocess.PIPE, text=True)
    try:
        for line in writer.stderr:  # until it has rewritten the checkpoint once
            if "checkpoint after step" in line:
                break
        for _ in range(100):
            code, _, err = run_main(capsys, *TRAIN, "--steps", "1", "--resume", folder)
            assert code == 2 and f"--resume {folder} is in use by another run" in err.splitlines()[-1], err
        assert writer.poll() is None, "the writer ended early"
    finally:
        writer.kill()
        writer.wait()


REFUSED = {
    "another model": (["--layers", "2"], "a checkpoint of another model"),
    "another dtype": (["--dtype", "float32"], "a checkpoint of another dtype"),
    "another Adam": (["--lr", "0.001"], "a checkpoint of another Adam setting"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_resume_refuses_another_run(checkpoint, case, capsys):
    args, message = REFUSED[case]
    code, _, err = run_main(capsys, *TRAIN, "--resume", checkpoint, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_refused_paths(checkpoint, tmp_path, capsys):
    """Each refused before any model is built, with one line."""
    (tmp_path / "file").write_text("")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ol.CHECKPOINT_FILE).write_text((checkpoint / ol.CHECKPOINT_FILE).read_text())  # no unit file
    cases = {
        "holds a checkpoint already": ["--checkpoint", checkpoint],
        "no checkpoint.json there": ["--resume", tmp_path],
        "of the files checkpoint.json names are missing": ["--resume", broken],
        "is a file: give a folder": ["--save-pretrained", tmp_path / "file"],
        "does not exist": ["--checkpoint", tmp_path / "no" / "dir"],
        "the folder /proc cannot be written": ["--save-pretrained", "/proc/x"],
        "--checkpoint /proc/x: the folder /proc cannot be written": ["--checkpoint", "/proc/x"],  # not a lock's error
    }
    for message, args in cases.items():
        code, _, err = run_main(capsys, *TRAIN, *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert "building" not in err
    code, _, _ = run_main(capsys, *TRAIN, "--checkpoint", tmp_path / "new", "--resume", tmp_path)  # after the paths
    assert code == 2 and not (tmp_path / "new").exists(), "a refused run leaves no empty folder"


def test_resume_hints_at_the_mode_folders(checkpoint, tmp_path):
    """Several modes resume each from DIR/<mode>; one mode from its own: a mismatch says which folder to give."""
    config = ol.llama_config(ol.RunConfig(preset="tiny"))
    several = ol.RunConfig(preset="tiny", mode="cpu,gpu", train=True, resume=str(checkpoint))
    with pytest.raises(ol.UsageError, match="holds one mode's; several modes resume each from DIR/<mode>"):
        ol.check_saving(several, config)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / ol.CHECKPOINT_FILE).write_text((checkpoint / ol.CHECKPOINT_FILE).read_text())
    one = ol.RunConfig(preset="tiny", mode="cpu", train=True, resume=str(tmp_path))
    with pytest.raises(ol.UsageError, match="it holds the checkpoints of modes cpu: give one of their folders"):
        ol.check_saving(one, config)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--save-pretrained", "x"], "add --train"),
        (["--train", "--checkpoint-every", "2"], "--checkpoint-every does nothing without --checkpoint DIR"),
        (["--train", "--checkpoint", "x", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    ],
)
def test_bad_saving_flags(args, message, capsys):
    code, _, err = run_main(capsys, "--preset", "tiny", "--mode", "cpu", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_no_room_on_disk_is_refused(tmp_path, monkeypatch):
    """A folder without room for what will be written: one line saying how much is missing, before the run."""
    run = ol.RunConfig(preset="tiny", mode="cpu", train=True, checkpoint=str(tmp_path), steps=4, checkpoint_every=2)
    config = ol.llama_config(run)
    needed = 2 * 12 * ol.param_count(config)  # a second checkpoint is written while the first stays whole
    monkeypatch.setattr(ol.shutil, "disk_usage", lambda path: type("Usage", (), {"free": needed - 1})())
    with pytest.raises(ol.UsageError, match=r"3\.9 MiB to write, 1 byte more than is free there"):
        ol.check_saving(run, config)
    monkeypatch.setattr(ol.shutil, "disk_usage", lambda path: type("Usage", (), {"free": needed})())
    ol.check_saving(run, config)


def test_saved_output_without_room_is_refused_and_a_failed_write_ends_with_one_line(tmp_path, monkeypatch):
    """--save-output's room is checked before the run as the folders' is; a write that fails all the same (torch.save's
    zip writer says RuntimeError on a full disk) is an OSError naming the file, which main ends with one line."""
    run = ol.RunConfig(preset="tiny", mode="cpu", train=True, save_output=str(tmp_path / "out.pt"))
    config = ol.llama_config(run)
    logits = run.batch_size * run.seq_len * config.vocab_size * 4
    assert ol.save_output_bytes(run, config) >= logits + 4 * ol.param_count(config)
    monkeypatch.setattr(ol.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 2**20})())
    with pytest.raises(ol.UsageError, match=r"--save-output .*out\.pt: .* to write, .* more than is free there"):
        ol.check_saving(run, config)

    def full_disk(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 20480 vs 20368")

    monkeypatch.setattr(ol.torch, "save", full_disk)
    with pytest.raises(OSError, match="is its disk full") as e:
        ol.torch_save({}, str(tmp_path / "x.pt"), "out.pt")
    assert e.value.filename == "out.pt"


@pytest.mark.parametrize(
    "dtype, clip, resident",
    [("bfloat16", None, ()), ("bfloat16", None, (1,)), ("float16", None, (1,)), ("float32", 0.05, (1,))],
)
def test_offloaded_resume_equals_one_run(tmp_path, dtype, clip, resident):
    """The offloaded trainer, the CPU as its device: 4 steps against 2, a checkpoint, a new trainer resumed from it
    before placement, and 2 more: step counts, masters and moments bit for bit, with a resident unit, float16's loss
    scale and clipping."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=2))
    run = ol.RunConfig(preset="tiny", dtype=dtype)

    def train_and_save(steps, folder, resume_from=None):
        """`steps` steps (after a resume) and a checkpoint into `folder`."""
        trainer = offloaded_trainer(model, "cpu", 1, [ids], clip=clip)
        manifest = ol.checkpoint_manifest(run, model.config, "overlapped")
        if resume_from:
            manifest["resumed_from"] = ol.resume(trainer, resume_from, manifest)
        if resident:
            ol.place_on_gpu(trainer, resident)
        for _ in range(steps):
            trainer.step([ids])
        trainer.finish()
        ol.write_checkpoint(trainer, folder, manifest, steps)

    train_and_save(4, tmp_path / "one")
    train_and_save(2, tmp_path / "two")
    train_and_save(2, tmp_path / "two", resume_from=tmp_path / "two")
    assert_same_checkpoint(tmp_path / "one", tmp_path / "two")


def test_a_resume_under_other_plan_inputs_says_what_differs(capsys):
    """The checkpoint records the plan and what it was made from; a resume whose inputs differ (another cap, a host
    with less memory) says what differs, and goes on: the state resumes the same."""
    run = ol.RunConfig(preset="tiny", mode="overlapped", train=True)
    config = ol.llama_config(run)
    saved = ol.checkpoint_manifest(run, config, "overlapped", ol.make_plan(run, config, machine(host_gib=100)))
    capped = ol.dataclasses.replace(run, max_gpu_memory=2.0)
    now = ol.checkpoint_manifest(capped, config, "overlapped", ol.make_plan(capped, config, machine(host_gib=60)))
    assert json.loads(json.dumps(saved))["plan_inputs"] == saved["plan_inputs"]  # as checkpoint.json keeps it
    ol.say_plan_changes(saved, now)
    line = capsys.readouterr().err.strip()
    said = "resuming under other plan inputs than the checkpoint's: host_gib 100.0 -> 60.0; max_gpu_memory None -> 2.0"
    assert said in line
    ol.say_plan_changes(saved, saved)
    assert capsys.readouterr().err == ""
    drifted = saved | {"plan_inputs": saved["plan_inputs"] | {"host_gib": 100.0 * 1.04}}  # the kernel's, moving
    ol.say_plan_changes(saved, drifted)
    assert capsys.readouterr().err == ""
