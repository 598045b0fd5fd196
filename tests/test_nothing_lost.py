"""Nothing lost, tried as a hostile user would: no output overwrites or lands inside an input; damaged or unreadable
inputs, malformed torchrun variables and numbers out of range end with one line and exit code 2, the inputs
unchanged; SIGINT and SIGTERM while tokenizing, training or saving leave each output whole or absent; a damaged cache
entry is rebuilt."""

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import LlamaForCausalLM

import offload_llama as ol
from helpers import SCRIPT, cli, run_main

TINY = ["--preset", "tiny", "--mode", "cpu", "--seq-len", "32"]
TRAIN = [*TINY, "--train", "--no-inference", "--steps", "1"]


def checksums(folder) -> dict:
    """Every file under `folder` by path, with its bytes' sha256 (a link or FIFO by what it is)."""
    sums = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            if os.path.islink(path) or not (os.path.isfile(path) or os.path.isdir(path)):
                sums[path] = ("special", os.lstat(path).st_mode)
            elif os.path.isfile(path):
                sums[path] = hashlib.sha256(open(path, "rb").read()).hexdigest()  # noqa: SIM115
            else:
                sums[path] = "folder"
    return sums


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A corpus file and folder, a saved tiny model with a trained tokenizer, and a one-step checkpoint."""
    root = tmp_path_factory.mktemp("inputs")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 200)
    run = ol.RunConfig(data=str(corpus), train_tokenizer=300, data_cache=str(root / "cache"), seq_len=32)
    tokenizer = ol.prepare_data(run, 512)[1]
    model = LlamaForCausalLM(ol.llama_config(ol.RunConfig(preset="tiny")))
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "tokenizer")
    assert cli(*TRAIN, "--checkpoint", root / "checkpoint").returncode == 0
    return root


def refused(tmp_path, args, words, env=None, in_process=True, capsys=None):
    """The command line `args` ({tmp}: tmp_path) refused with one line holding `words`, exit code 2, no traceback,
    every file under tmp_path as it was; main() run in this process (env: the environment it sees), or in its own."""
    args = [str(a).replace("{tmp}", str(tmp_path)) for a in args]
    before = checksums(tmp_path)
    if in_process:
        code, out, err = main_in_process(args, env)
    else:
        r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300)
        code, out, err = r.returncode, r.stdout, r.stderr
    lines = [line for line in err.splitlines() if " s  " not in line[:12]]  # the refusal, not the progress lines
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and "building" not in err, err
    assert words in lines[0] and out == "", err
    assert checksums(tmp_path) == before


def main_in_process(args, env=None) -> tuple[int, str, str]:
    """main() in this process on `args`, seeing `env` (default: this one's) as its environment: (code, out, err)."""
    out, err, saved = io.StringIO(), io.StringIO(), dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = ol.main(args)
            except SystemExit as e:  # argparse's errors
                code = e.code
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def copied(inputs, tmp_path, *names):
    """The named inputs copied into tmp_path, where a test may damage them."""
    for name in names:
        source = inputs / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)


CLASHES = {  # an output on or inside an input: one line naming both flags
    "--json on the corpus": (["--data", "{tmp}/corpus/0.txt", "--json", "{tmp}/corpus/0.txt"], "--json {tmp}/corpus"),
    "--save-output on the corpus": (
        ["--data", "{tmp}/corpus/0.txt", "--save-output", "{tmp}/corpus/0.txt"],
        "is --data",
    ),
    "--json on the script": (["--json", SCRIPT], "is the script"),
    "--json inside --model": (["--model", "{tmp}/model", "--json", "{tmp}/model/r.json"], "lies inside --model"),
    "--save-pretrained on --model": (["--model", "{tmp}/model", "--save-pretrained", "{tmp}/model"], "is --model"),
    "--save-pretrained on --tokenizer": (
        ["--data", "{tmp}/corpus", "--tokenizer", "{tmp}/tokenizer", "--save-pretrained", "{tmp}/tokenizer"],
        "is --tokenizer",
    ),
    "--save-pretrained on --resume": (
        ["--resume", "{tmp}/checkpoint", "--save-pretrained", "{tmp}/checkpoint"],
        "is --resume",
    ),
    "--save-pretrained inside --data": (
        ["--data", "{tmp}/corpus", "--save-pretrained", "{tmp}/corpus/out"],
        "lies inside --data",
    ),
    "--checkpoint inside --data": (["--data", "{tmp}/corpus", "--checkpoint", "{tmp}/corpus/ck"], "lies inside --data"),
    "--nvme inside --model": (["--model", "{tmp}/model", "--nvme", "{tmp}/model"], "is --model"),
    "--data-cache on --save-pretrained": (
        ["--data", "{tmp}/corpus", "--data-cache", "{tmp}/out", "--save-pretrained", "{tmp}/out"],
        "both name",
    ),
    "--save-pretrained holding the corpus": (["--data", "{tmp}/corpus/0.txt", "--save-pretrained", "{tmp}"], "holds"),
    "--json inside --save-pretrained": (["--save-pretrained", "{tmp}/out", "--json", "{tmp}/out/r.json"], "nest"),
    "--json on --checkpoint's record": (["--checkpoint", "{tmp}/out", "--json", "{tmp}/out/checkpoint.json"], "nest"),
    "--json on a hard link to the corpus": (["--data", "{tmp}/corpus/0.txt", "--json", "{tmp}/hard.txt"], "is --data"),
    "--checkpoint in a folder of the user's": (["--checkpoint", "{tmp}/corpus"], "holds 0.txt (a file), which a"),
}


@pytest.mark.parametrize("case", CLASHES)
def test_an_output_on_or_inside_an_input_is_refused(case, inputs, tmp_path):
    copied(inputs, tmp_path, "corpus", "model", "tokenizer", "checkpoint")
    (tmp_path / "out").mkdir()  # an empty folder: an output
    os.link(tmp_path / "corpus" / "0.txt", tmp_path / "hard.txt")  # another name of the corpus's file
    args, words = CLASHES[case]
    model = ["--mode", "overlapped"] if "--model" in args else ["--preset", "tiny", "--mode", "overlapped"]
    refused(tmp_path, [*model, "--train", *args], words.replace("{tmp}", str(tmp_path)))


LINKED = {  # an output on what a link inside an input folder reaches, or a glob that leaves --data
    "--json on a file a link in the corpus reaches": (
        ["--data", "{tmp}/corpus", "--json", "{tmp}/outside.txt"],
        "is {tmp}/outside.txt, which --data reads through {tmp}/corpus/link.txt",
    ),
    "--save-output on weights --model links to": (
        ["--model", "{tmp}/model", "--save-output", "{tmp}/weights.safetensors"],
        "which --model reads through {tmp}/model/model.safetensors",
    ),
    "--data-glob climbing out of --data": (["--data", "{tmp}/corpus", "--data-glob", "../*.txt"], "give patterns"),
    "--data-glob from the root": (["--data", "{tmp}/corpus", "--data-glob", "/etc/*"], "give patterns relative"),
}


@pytest.mark.parametrize("case", LINKED)
def test_what_a_link_in_an_input_reaches_is_an_input_too(case, inputs, tmp_path, capsys):
    """A corpus file that is a link, a model's weights linked from elsewhere (as in a Hugging Face cache): an output
    there would replace what the run reads; a --data-glob reaching out of --data is refused as it is given."""
    copied(inputs, tmp_path, "corpus", "model")
    (tmp_path / "outside.txt").write_text("def g(x):\n    return x\n" * 200)
    os.symlink("../outside.txt", tmp_path / "corpus" / "link.txt")
    (tmp_path / "model" / "model.safetensors").rename(tmp_path / "weights.safetensors")
    os.symlink("../weights.safetensors", tmp_path / "model" / "model.safetensors")
    args, words = LINKED[case]
    model = [] if "--model" in args else ["--preset", "tiny"]
    refused(
        tmp_path,
        [*model, "--mode", "cpu", "--train", *args],
        words.replace("{tmp}", str(tmp_path)),
        in_process=True,
        capsys=capsys,
    )


@pytest.mark.slow
def test_the_documented_resume_into_its_own_folder_is_no_clash(inputs, tmp_path):
    copied(inputs, tmp_path, "checkpoint")
    folder = tmp_path / "checkpoint"
    assert cli(*TRAIN, "--resume", folder, "--checkpoint", folder).returncode == 0
    assert json.loads((folder / ol.CHECKPOINT_FILE).read_text())["steps"] == 2


def special_files(tmp_path) -> dict:
    """A FIFO, a socket, a character device (as root), and links to a file and to a folder."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "socket"))
    sock.close()
    os.symlink(tmp_path / "file", tmp_path / "link")
    os.symlink(tmp_path / "folder", tmp_path / "folder_link")
    kinds = {"fifo": "a FIFO", "socket": "a socket", "link": "a symbolic link"}
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", 0o666 | 0o020000, os.makedev(1, 3))  # a copy of /dev/null
        kinds["null"] = "a device"
    return kinds


@pytest.mark.parametrize("flag", ["--json", "--save-output", "--profile"])
def test_a_file_output_never_replaces_a_link_fifo_socket_or_device(flag, tmp_path):
    kinds = special_files(tmp_path)
    mode = ["--mode", "overlapped"] if flag == "--profile" else []
    for name, kind in kinds.items():
        refused(tmp_path, [*TINY, *mode, flag, f"{{tmp}}/{name}"], f"is {kind}, which the run would replace")


def test_folder_outputs_refuse_what_they_would_replace(tmp_path):
    special_files(tmp_path)
    refused(tmp_path, [*TINY, "--train", "--save-pretrained", "{tmp}/folder_link"], "is a symbolic link")
    refused(tmp_path, [*TINY, "--train", "--checkpoint", "{tmp}/fifo"], "is a FIFO")
    refused(tmp_path, [*TINY, "--train", "--save-pretrained", "{tmp}"], "the folder is replaced whole")
    refused(tmp_path, [*TINY, "--train", "--data", "{tmp}/file", "--data-cache", "{tmp}/file"], "is a file")


def user_entries(folder, *names) -> None:
    """The user's entries in `folder` named as a write of the run's names its own: a folder holding the user's notes
    (a sub-folder named like a weights file), a link, or a file of a name the run never writes."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.startswith("link:"):
            os.symlink(folder.parent / "notes.txt", folder / name.removeprefix("link:"))
        elif name.endswith("/"):
            (folder / name).mkdir()
            (folder / name / "NOTES.txt").write_text("mine")
        else:
            (folder / name).write_text("mine")


FOREIGN = {  # an output folder holding an entry no write of the run's leaves, and how the refusal names it
    "--save-pretrained: a folder named like a shard": (
        ["--save-pretrained", "{tmp}/out"],
        ("out", "config.json", "model-old.safetensors/"),
        "holds model-old.safetensors (a folder), which a saved model does not hold",
    ),
    "--save-pretrained: a link named as the weights": (
        ["--save-pretrained", "{tmp}/out"],
        ("out", "link:model.safetensors"),
        "holds model.safetensors (a symbolic link)",
    ),
    "--save-pretrained: a file of another name": (
        ["--save-pretrained", "{tmp}/out"],
        ("out", "model-notes.safetensors"),
        "holds model-notes.safetensors (a file)",
    ),
    "--save-pretrained: a mode's folder that is a file": (
        ["--mode", "cpu,gpu", "--save-pretrained", "{tmp}/out"],
        ("out", "cpu"),
        "out/cpu is a file, which the run would replace",
    ),
    "--checkpoint: notes beside a checkpoint it goes on from": (
        ["--resume", "{tmp}/checkpoint", "--checkpoint", "{tmp}/checkpoint"],
        ("checkpoint", "NOTES.txt"),
        "holds NOTES.txt (a file), which a checkpoint does not",
    ),
    "--checkpoint: a link named as a unit file": (
        ["--checkpoint", "{tmp}/ck"],
        ("ck", "unit000.step1.pt", "link:unit001.step1.pt"),
        "holds unit001.step1.pt (a symbolic link)",
    ),
    "--checkpoint: a folder named as its tokenizer's": (
        ["--checkpoint", "{tmp}/ck"],
        ("ck", "unit000.step1.pt", "tokenizer.json/"),
        "holds tokenizer.json (a folder)",
    ),
    "--checkpoint: a mode's folder that is a link": (
        ["--mode", "cpu,gpu", "--checkpoint", "{tmp}/ck"],
        ("ck", "link:cpu"),
        "ck/cpu is a symbolic link: give a folder",
    ),
}


@pytest.mark.parametrize("case", FOREIGN)
def test_a_folder_output_replaces_only_what_a_write_of_its_own_left(case, inputs, tmp_path, capsys):
    """Its regular files by the exact names it writes: anything else there refuses the run before it starts, named,
    and stays as it was (before, --save-pretrained replaced a folder holding model-old.safetensors/NOTES.txt)."""
    copied(inputs, tmp_path, "checkpoint")
    (tmp_path / "notes.txt").write_text("the user's")
    args, (folder, *names), words = FOREIGN[case]
    user_entries(tmp_path / folder, *names)
    refused(tmp_path, [*TRAIN, *args], words, in_process=True, capsys=capsys)


CACHE_ENTRIES = {  # a --data-cache entry the run would rebuild, of a kind no write of its own leaves
    "the token cache's name on a folder": ("tokens-", "a folder", "is a folder, where the run caches token ids"),
    "the tokenizer's name on a file": ("tokenizer-", "a file", "is a file, where the run caches a tokenizer's folder"),
    "a tokenizer that does not load, with notes": (
        "tokenizer-",
        "notes",
        "holds NOTES.txt (a file), which training it again",
    ),
}


@pytest.mark.parametrize("case", CACHE_ENTRIES)
def test_a_data_cache_entry_it_would_rebuild_is_one_of_its_own(case, inputs, tmp_path, capsys):
    """The token cache is a regular file, a cached tokenizer a folder of its files: a folder, a file or a notes file
    where the run would remove one to write it again is refused, named, before the model is built."""
    shutil.copytree(inputs / "cache", tmp_path / "cache")
    prefix, damage, words = CACHE_ENTRIES[case]
    (entry,) = (tmp_path / "cache").glob(f"{prefix}*")
    if damage == "notes":
        (entry / "tokenizer.json").write_text("")
        (entry / "NOTES.txt").write_text("mine")
    else:
        ol.remove_path(entry)
        entry.mkdir() if damage == "a folder" else entry.write_text("mine")
    args = [*TRAIN, "--data", inputs / "corpus", "--train-tokenizer", "300", "--vocab-size", "300"]
    refused(tmp_path, [*args, "--data-cache", "{tmp}/cache"], words, in_process=True, capsys=capsys)


def test_the_disk_tier_leaves_what_its_folder_held(tmp_path):
    """--nvme's files have no name (or lose theirs at once): the user's entries there, look-alikes of the fallback's
    temporary names included, stay as they were."""
    user_entries(tmp_path / "disk", "NOTES.txt", ".offload_llama-abc", "sub/", "link:link")
    before = checksums(tmp_path)
    tier = ol.DiskTier(str(tmp_path / "disk"), {1: 2**16, 2: 2**16})
    tier.close()
    assert checksums(tmp_path) == before


def test_damaged_weights_in_other_forms_are_refused(inputs, tmp_path, capsys):
    """pytorch_model.bin that is not a torch file, a shard the index names that is not there: one line before the
    build; a weight holding NaN: one line once the weights are read (it would run NaN logits, or blame --lr)."""
    copied(inputs, tmp_path, "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(b"garbage" * 100)
    args = ["--model", "{tmp}/model", "--mode", "cpu"]
    refused(tmp_path, args, "pytorch_model.bin is damaged, not a torch file", in_process=True, capsys=capsys)
    (tmp_path / "model" / "pytorch_model.bin").unlink()
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(tmp_path, args, "model-00002-of-00002.safetensors is missing", in_process=True, capsys=capsys)
    (tmp_path / "model" / "model.safetensors.index.json").unlink()
    model = LlamaForCausalLM.from_pretrained(inputs / "model")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "model")
    capsys.readouterr()
    code, _, err = run_main(capsys, "--model", tmp_path / "model", "--mode", "cpu")
    assert code == 2 and "model.layers.1.mlp.down_proj.weight holds NaN or infinite values" in err.splitlines()[-1]


def test_damaged_inputs_are_refused_before_the_model_is_built(inputs, tmp_path, capsys):
    copied(inputs, tmp_path, "model", "tokenizer", "checkpoint", "corpus")
    weights = tmp_path / "model" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    refused(
        tmp_path, ["--model", "{tmp}/model", "--mode", "cpu"], "is damaged or cut short", in_process=True, capsys=capsys
    )
    model = LlamaForCausalLM(ol.llama_config(ol.RunConfig(preset="tiny", sizes=(("hidden_size", 32),))))
    model.save_pretrained(tmp_path / "other")
    capsys.readouterr()  # its progress bar
    shutil.copy(tmp_path / "other" / "model.safetensors", weights)  # of another size than config.json's
    refused(tmp_path, ["--model", "{tmp}/model", "--mode", "cpu"], "the config needs", in_process=True, capsys=capsys)
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{")
    args = [*TRAIN, "--data", "{tmp}/corpus", "--tokenizer", "{tmp}/tokenizer"]
    refused(tmp_path, args, "its tokenizer does not load", in_process=True, capsys=capsys)
    record = tmp_path / "checkpoint" / ol.CHECKPOINT_FILE
    unit = next((tmp_path / "checkpoint").glob("unit001*.pt"))
    unit.write_bytes(unit.read_bytes()[:100])
    args = [*TRAIN, "--resume", "{tmp}/checkpoint"]
    refused(tmp_path, args, f"{unit.name} does not load", in_process=True, capsys=capsys)
    record.write_text(json.dumps(json.loads(record.read_text()) | {"files": "unit000.pt"}))
    refused(tmp_path, args, "checkpoint.json's files is 'unit000.pt'", in_process=True, capsys=capsys)
    record.write_text("[]")
    refused(tmp_path, args, "holds no record", in_process=True, capsys=capsys)
    shutil.copy(inputs / "checkpoint" / ol.CHECKPOINT_FILE, record)
    record.write_text(json.dumps(json.loads(record.read_text()) | {"steps": -5}))
    refused(tmp_path, args, "step counts are out of range", in_process=True, capsys=capsys)
    original = json.loads((inputs / "checkpoint" / ol.CHECKPOINT_FILE).read_text())
    for ranks in ("2", 0, True):  # any number of ranks resumes a checkpoint, but its record must say a number of them
        record.write_text(json.dumps(original | {"ranks": ranks}))
        refused(tmp_path, args, f"checkpoint.json's ranks is {ranks!r}", in_process=True, capsys=capsys)
    for key, value in [("tokens", -64), ("tokens", 2**63), ("batch_size", "1"), ("grad_accum", [1]), ("seq_len", None)]:
        record.write_text(json.dumps(original | {key: value}))
        damaged = f"checkpoint.json's {key} is {value!r}: the file is damaged"
        refused(tmp_path, args, damaged, in_process=True, capsys=capsys)
    record.write_text(json.dumps(original | {"plan_inputs": "x"}))
    refused(tmp_path, args, "checkpoint.json's plan_inputs is not a table", in_process=True, capsys=capsys)
    record.write_text(json.dumps(original | {"ranks": 2}))  # a file a unit, where 2 ranks write two
    refused(tmp_path, args, "names 6 files, not 12", in_process=True, capsys=capsys)
    twice = [*original["files"][:2], original["files"][1], *original["files"][3:]]  # one layer's file for the next's
    record.write_text(json.dumps(original | {"files": twice}))
    refused(tmp_path, args, f"names {original['files'][1]} where", in_process=True, capsys=capsys)
    shutil.copy(inputs / "checkpoint" / ol.CHECKPOINT_FILE, record)
    state = torch.load(inputs / "checkpoint" / unit.name)
    torch.save(state | {"step": 4}, unit)  # a whole number, where unit_state writes a float count
    refused(tmp_path, args, f"{unit.name} does not hold unit", in_process=True, capsys=capsys)
    next_layer = unit.with_name(unit.name.replace("unit001", "unit002"))
    torch.save(state, unit)
    torch.save(state, next_layer)  # the first layer's state where the second's goes: of the same shapes
    refused(tmp_path, args, f"{next_layer.name} does not hold unit model.layers.1", in_process=True, capsys=capsys)
    index = tmp_path / "model" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": 1}}))
    args = ["--model", "{tmp}/model", "--mode", "cpu"]
    refused(tmp_path, args, "model.safetensors.index.json is damaged", in_process=True, capsys=capsys)
    (tmp_path / "lone.jsonl").write_text('{"text": "a\\ud800"}\n')
    args = [*TRAIN, "--data", "{tmp}/lone.jsonl", "--train-tokenizer", "300", "--vocab-size", "300"]
    refused(tmp_path, args, "line 1 holds a lone surrogate", in_process=True, capsys=capsys)


def test_unreadable_inputs_are_refused_at_once(inputs, tmp_path, monkeypatch, capsys):
    """As root the permission bits let everything be read: the refusal is checked on a listing that fails."""
    copied(inputs, tmp_path, "model", "corpus")
    os.mkfifo(tmp_path / "fifo")
    refused(tmp_path, [*TRAIN, "--data", "{tmp}/fifo", "--train-tokenizer", "300"], "is a FIFO: give a file")
    refused(tmp_path, [*TRAIN, "--resume", "{tmp}/corpus/0.txt"], "is a file: give a folder")
    refused(tmp_path, [*TRAIN, "--data", "{tmp}/missing"], "no such file or folder")
    listdir = os.listdir

    def denied(path):
        if str(path).startswith(str(tmp_path)):
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(ol.os, "listdir", denied)
    args = ["--model", "{tmp}/model", "--mode", "cpu"]
    refused(tmp_path, args, "cannot be read (Permission denied)", in_process=True, capsys=capsys)


RANKS = {
    "WORLD_SIZE=abc": ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a count"),
    "RANK=abc": ({"WORLD_SIZE": "2", "RANK": "abc"}, "RANK='abc' is not a count"),
    "LOCAL_WORLD_SIZE=abc": ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE='abc'"),
    "WORLD_SIZE=0": ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    "RANK=3 WORLD_SIZE=1": ({"WORLD_SIZE": "1", "RANK": "3"}, "RANK=3 must be at least 0 and below WORLD_SIZE=1"),
    "LOCAL_RANK=2 of 2": ({"WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be at least 0 and below"),
    "LOCAL_WORLD_SIZE=4 of 2": ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "exceeds WORLD_SIZE"),
    "WORLD_SIZE=²": ({"WORLD_SIZE": "\u00b2"}, "is not a count"),
}


@pytest.mark.parametrize("case", RANKS)
def test_malformed_torchrun_variables_are_refused(case, tmp_path):
    variables, words = RANKS[case]
    refused(tmp_path, ["--mode", "overlapped", "--train"], words, env=os.environ | variables)


NUMBERS = {
    "--seed 2**70": (["--seed", str(2**70)], f"--seed must be between 0 and {ol.MAX_SEED}"),
    "--seed -1": (["--seed", "-1"], "--seed must be between 0"),
    "--vocab-size 1": (["--vocab-size", "1"], "--vocab-size must be at least 2"),
    "--layers 1000000": (["--layers", "1000000"], "use fewer or smaller layers"),
    "--seq-len 10**11": (["--seq-len", str(10**11)], "use fewer or shorter sequences"),
    "--batch-size 10**11": (["--train", "--batch-size", str(10**11)], "use fewer or shorter sequences"),
    "an empty --json": (["--json", ""], "--json is empty"),
    "--sample-tokens 1e9": (
        ["--train", "--sample", "x", "--sample-tokens", str(10**9)],
        "the model has 4096 positions",
    ),
    "--epochs nan": (["--train", "--data", "x", "--epochs", "nan"], "--epochs must be a positive number"),
    "--seq-len 1 to train": (["--train", "--seq-len", "1"], "--seq-len must be at least 2 with --train"),
}


@pytest.mark.parametrize("case", NUMBERS)
def test_numbers_out_of_range_are_refused_at_once(case, tmp_path):
    args, words = NUMBERS[case]
    refused(tmp_path, [*TINY, *args], words)


ALWAYS_MEANINGFUL = {"mode", "preset", "model", "dtype", "attention", "batch_size", "seq_len", "seed", "train"}
ALWAYS_MEANINGFUL |= {"max_host_memory", "json", "save_output", *ol.SIZE_FLAGS}
ALWAYS_MEANINGFUL |= {"plan", "rank_timeout"}  # the plan of any run; the ranks' timeout (one process: none to wait on)


def test_every_flag_is_in_the_table_of_what_it_needs_or_always_does_something():
    p = ol.Parser()
    for add in (ol.add_run_flags, ol.add_training_flags, ol.add_data_flags, ol.add_saving_flags, ol.add_plan_flags):
        add(p)
    dests = {action.dest for action in p._actions if action.dest != "help"}
    tabled = {dest for flags, _ in ol.FLAG_NEEDS for dest in flags}
    assert dests == tabled | ALWAYS_MEANINGFUL and not tabled & ALWAYS_MEANINGFUL


DOING_NOTHING = {  # a flag that does nothing in the run asked for, and what the refusal says it needs
    "--steps without --train": (["--steps", "5"], "--steps does nothing without --train"),
    "--lr without --train": (["--lr", "0.1"], "--lr does nothing without --train"),
    "--text-field with a .txt file": (["--train", "--data", "a.txt", "--text-field", "t"], "JSONL in --data"),
    "--data-glob with a file": (["--train", "--data", "a.txt", "--data-glob", "*.py"], "a folder as --data"),
    "--temperature without --sample": (["--temperature", "1"], "--temperature does nothing without --sample"),
    "--sample-tokens without --sample": (["--sample-tokens", "5"], "without --sample PROMPT"),
    "--eval-fraction without --data": (["--train", "--eval-fraction", "0.5"], "without --data PATH"),
    "--skip-undecodable without --data": (["--skip-undecodable"], "without --data PATH"),
    "--prefetch with cpu": (["--mode", "cpu", "--prefetch", "2"], "without overlapped mode"),
    "--gpu-adam-share with cpu": (["--mode", "cpu", "--train", "--gpu-adam-share", "0.5"], "overlapped mode"),
    "--warmup with cpu inference": (["--mode", "cpu", "--warmup", "3"], "without a GPU mode or --train"),
    "--repeat with cpu": (["--mode", "cpu", "--repeat", "3"], "--repeat does nothing without a GPU mode"),
    "--max-gpu-memory with cpu": (["--mode", "cpu", "--max-gpu-memory", "100"], "without a GPU mode"),
    "--epochs beside --steps": (["--train", "--data", "a.txt", "--steps", "5", "--epochs", "1"], "give one"),
    "--steps at its default beside --epochs": (["--train", "--data", "a.txt", "--epochs", "1", "--steps", "10"], "one"),
    "--top-k without --temperature": (["--train", "--sample", "x", "--top-k", "5"], "add --temperature T"),
    "--checkpoint-every without --checkpoint": (["--train", "--checkpoint-every", "2"], "without --checkpoint DIR"),
}


@pytest.mark.parametrize("case", DOING_NOTHING)
def test_a_flag_that_does_nothing_is_refused_saying_what_it_needs(case, capsys):
    args, words = DOING_NOTHING[case]
    with pytest.raises(SystemExit) as e:
        ol.command_line(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_the_saved_folder_generates_as_it_trained(inputs, tmp_path):
    """Its configs carry the trained tokenizer's ids (end of text 0, not the preset's 2): generate on it stops at the
    end of text and nowhere else (before, at '"', id 2)."""
    args = [*TRAIN, "--data", inputs / "corpus", "--train-tokenizer", "300", "--vocab-size", "300"]
    r = cli(*args, "--data-cache", inputs / "cache", "--save-pretrained", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    tokenizer = ol.transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    eos = tokenizer.eos_token_id
    assert eos == tokenizer.convert_tokens_to_ids(ol.END_OF_TEXT) == 0
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos
    assert model.config.bos_token_id == model.config.pad_token_id == model.generation_config.pad_token_id == eos

    def next_token(token: int) -> list[int]:
        """What generate adds after a prompt when the head always picks `token`."""
        model.lm_head.forward = lambda h: torch.nn.functional.one_hot(torch.full(h.shape[:-1], token), 300).float()
        return model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False)[0, 2:].tolist()

    assert next_token(2) == [2, 2, 2, 2] and next_token(eos) == [eos]


def interrupted(args, trigger, sig, cwd) -> subprocess.CompletedProcess:
    """Run the command line in `cwd`; once trigger(stderr so far) is true, send `sig`; return what it did. A trigger
    not met within two minutes fails the test."""
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *map(str, args)], stderr=subprocess.PIPE, text=True, cwd=cwd
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    try:
        while not trigger("".join(lines)):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.001)  # the writes watched for take far longer
        process.send_signal(sig)
        process.wait(timeout=120)
    finally:
        process.kill()
        process.wait()
    reader.join()
    return subprocess.CompletedProcess(process.args, process.returncode, "", "".join(lines))


def whole_or_absent(cwd, r, sig) -> None:
    """The run ended by `sig` with one line; --save-pretrained's folder is absent or loads, --checkpoint's holds
    exactly what its record names, each cache entry loads, and no temporary file or folder is left anywhere."""
    assert r.returncode == 128 + sig, r.stderr  # 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP
    assert "Traceback" not in r.stderr and "each output is whole or absent" in r.stderr.strip().splitlines()[-1]
    if (cwd / "out").exists():
        LlamaForCausalLM.from_pretrained(cwd / "out")
        ol.transformers.AutoTokenizer.from_pretrained(cwd / "out")
    if (cwd / "ck").exists():
        record = json.loads((cwd / "ck" / ol.CHECKPOINT_FILE).read_text())
        named = [*record["files"], *record["tokenizer"], ol.CHECKPOINT_FILE]
        assert sorted(p.name for p in (cwd / "ck").iterdir()) == sorted(named)
    for entry in (cwd / "cache").iterdir() if (cwd / "cache").exists() else ():
        if entry.name.startswith("tokenizer-"):
            ol.transformers.AutoTokenizer.from_pretrained(entry)
        else:
            assert ol.mapped_tokens(entry) is not None, entry
    assert not [p for p in cwd.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]


SIZES = ["--hidden-size", "512", "--intermediate-size", "1408", "--layers", "4", "--heads", "8", "--kv-heads", "8"]
TRAINED = ["--train-tokenizer", "300"]
WHILE = {  # what the run does when the signal comes: its text, how it gets its tokenizer, and how that shows
    "training the tokenizer": ("ws.txt", TRAINED, lambda cwd, err: "tokenizer: training" in err),
    "tokenizing": ("big.txt", ["--tokenizer", "tokenizer"], lambda cwd, err: any((cwd / "cache").glob(".tokens-*"))),
    "training": ("corpus", TRAINED, lambda cwd, err: "step 3:" in err),
    "writing a checkpoint": ("corpus", TRAINED, lambda cwd, err: "checkpoint after" in err and any(cwd.glob("ck/.u*"))),
    "saving the model": ("corpus", TRAINED, lambda cwd, err: any(cwd.glob(".out.*"))),
}


SIGNALS = [(doing, sig) for doing in WHILE for sig in (signal.SIGINT, signal.SIGTERM)]
SIGNALS += [("writing a checkpoint", signal.SIGHUP), ("tokenizing", signal.SIGHUP)]  # a terminal that closed


@pytest.mark.slow
@pytest.mark.parametrize(("doing", "sig"), SIGNALS, ids=[f"{doing}-{sig.name}" for doing, sig in SIGNALS])
def test_a_signal_leaves_every_output_whole_or_absent(doing, sig, inputs, tmp_path):
    data, tokenizer, trigger = WHILE[doing]
    copied(inputs, tmp_path, "corpus", "tokenizer")
    (tmp_path / "ws.txt").write_text(" " * 300_000)  # its BPE trains for a minute: the signal comes meanwhile
    (tmp_path / "big.txt").write_text((inputs / "corpus" / "0.txt").read_text() * 2000)  # 7 MB: tokenized for seconds
    steps = "8" if doing == "saving the model" else "100000"
    args = [*TINY, "--train", "--no-inference", *SIZES, "--vocab-size", "300", "--steps", steps, "--data", data]
    args += ["--dtype", "float32"]  # the CPU's fastest
    args += [*tokenizer, "--data-cache", "cache", "--save-pretrained", "out", "--checkpoint", "ck"]
    r = interrupted([*args, "--checkpoint-every", "1"], lambda err: trigger(tmp_path, err), sig, tmp_path)
    whole_or_absent(tmp_path, r, sig)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["ids past the vocabulary"])
def test_a_cache_entry_of_the_wrong_kind_is_rebuilt(damage, inputs, tmp_path, capsys):
    shutil.copytree(inputs / "cache", tmp_path / "cache")
    (tokens,) = (tmp_path / "cache").glob("tokens-*")
    data = bytearray(tokens.read_bytes())
    data[ol.TOKEN_START : ol.TOKEN_START + 2] = (299 + 1000).to_bytes(2, "little")
    tokens.write_bytes(data)
    args = [*TRAIN, "--data", inputs / "corpus", "--train-tokenizer", "300", "--vocab-size", "300"]
    code, _, err = run_main(capsys, *args, "--data-cache", tmp_path / "cache")
    assert code == 0 and "note: the " in err, err
    assert ol.mapped_tokens(tokens) is not None and ol.largest_id(ol.mapped_tokens(tokens)) < 300
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def test_a_full_disk_ends_with_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """An OSError of the write itself carries no file name: the line names the output."""

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ol.Path, "write_text", full)
    code, _, err = run_main(capsys, *TINY, "--json", tmp_path / "r.json")
    assert code == 1 and err.strip().splitlines()[-1].endswith(f"No space left on device: {tmp_path / 'r.json'}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_train_tokenizer_trains_one_beside_a_model_that_has_its_own(inputs, tmp_path, capsys):
    """--train-tokenizer asks for a tokenizer trained on the data: the model folder's is not used instead."""
    model = LlamaForCausalLM(ol.llama_config(ol.RunConfig(preset="tiny", sizes=(("vocab_size", 300),))))
    model.save_pretrained(tmp_path / "model")
    shutil.copytree(inputs / "tokenizer", tmp_path / "model", dirs_exist_ok=True)
    args = ["--model", tmp_path / "model", "--mode", "cpu", "--seq-len", "32", "--train", "--no-inference"]
    args += ["--steps", "1", "--data", inputs / "corpus", "--train-tokenizer", "280", "--data-cache", tmp_path / "c"]
    code, _, err = run_main(capsys, *args)
    assert code == 0 and "tokenizer: a byte-level BPE of" in err, err


@pytest.mark.slow
def test_a_damaged_cache_entry_is_rebuilt_with_a_note(inputs, tmp_path, capsys):
    """A 0-byte tokenizer.json (a disk that filled) and a token file cut short: each rebuilt, said in one line."""
    shutil.copytree(inputs / "cache", tmp_path / "cache")
    (tokenizer,) = (tmp_path / "cache").glob("tokenizer-*")
    (tokenizer / "tokenizer.json").write_text("")
    args = [*TRAIN, "--data", inputs / "corpus", "--train-tokenizer", "300", "--vocab-size", "300"]
    code, _, err = run_main(capsys, *args, "--data-cache", tmp_path / "cache")
    assert code == 0 and f"note: the cached tokenizer {tokenizer} does not load" in err
    ol.transformers.AutoTokenizer.from_pretrained(tokenizer)
    (tokens,) = (tmp_path / "cache").glob("tokens-*")
    tokens.write_bytes(tokens.read_bytes()[:-3])
    code, _, err = run_main(capsys, *args, "--data-cache", tmp_path / "cache")
    assert code == 0 and f"note: the token cache {tokens} is not whole: tokenized again" in err
    assert ol.mapped_tokens(tokens) is not None


def test_a_diverged_run_ends_with_one_line_and_writes_no_state_that_is_not_finite(tmp_path, capsys):
    """--lr 1e300: the first update overflows the masters, which the next step's loss would only show. Neither the
    checkpoint after it nor the saved model is written: the run ends with one line, exit 1."""
    args = [*TRAIN[:-1], "2", "--lr", "1e300", "--checkpoint", tmp_path / "ck", "--save-pretrained", tmp_path / "sp"]
    code, out, err = run_main(capsys, *args, "--checkpoint-every", "1", "--json", tmp_path / "r.json")
    lines = [line for line in err.splitlines() if " s  " not in line[:12]]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "after step 1 model.embed_tokens's state is not finite" in lines[0] and "diverged" in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no checkpoint, no saved model, no JSON


def test_a_checkpoint_whose_state_is_not_finite_is_refused(inputs, tmp_path, capsys):
    """A unit file of a checkpoint filled with NaN (damaged, or a diverged run's): refused with one line naming the
    unit, exit 2, before any step."""
    copied(inputs, tmp_path, "checkpoint")
    folder = tmp_path / "checkpoint"
    record = json.loads((folder / ol.CHECKPOINT_FILE).read_text())
    state = torch.load(folder / record["files"][2])
    for t in state["master"].values():
        t.fill_(float("nan"))
    torch.save(state, folder / record["files"][2])
    code, _, err = run_main(capsys, *TRAIN, "--resume", folder)
    assert code == 2 and "Traceback" not in err and "step 1: loss" not in err, err
    assert "--resume" in err and "model.layers.1's state is not finite" in err, err


def test_a_loss_that_is_not_finite_ends_the_run(tmp_path, capsys):
    """With nothing to write between the steps, the diverged run ends at the first loss that is not finite."""
    code, _, err = run_main(capsys, *TRAIN[:-1], "3", "--lr", "1e300", "--json", tmp_path / "r.json")
    assert code == 1 and "step 2's loss is nan: training diverged" in err and "step 3" not in err, err
    assert not (tmp_path / "r.json").exists()


OUT_OF_DOMAIN = {  # a config.json value the model cannot compute with, the run, and the field's refusal
    "rope_theta 0": ({"rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}}, [], "rope_theta is 0.0, not a"),
    "rope_theta -10000, an older config's": (
        {"rope_parameters": None, "rope_theta": -10000.0},
        ["--train"],
        "rope_theta is -10000.0, not a positive number",
    ),
    "rms_norm_eps -1": ({"rms_norm_eps": -1.0}, ["--train"], "rms_norm_eps is -1.0, not a positive number"),
    "rms_norm_eps 0": ({"rms_norm_eps": 0.0}, [], "rms_norm_eps is 0.0, not a positive number"),
    "max_position_embeddings under --seq-len": (
        {"max_position_embeddings": 16},
        ["--seq-len", "64"],
        "max_position_embeddings is 16, fewer than --seq-len 64: give --seq-len 16 at most",
    ),
    "pad_token_id past the vocabulary": ({"pad_token_id": 9999}, [], "pad_token_id is 9999, not an id of its"),
    "fewer layers than the weights hold": (
        {"num_hidden_layers": 2},
        [],
        "such as model.layers.2.input_layernorm.weight (num_hidden_layers is 2, the weights hold 3 layers)",
    ),
    "more layers than the weights hold": (
        {"num_hidden_layers": 4},
        [],
        "model.layers.3.self_attn.q_proj.weight is missing",
    ),
}


@pytest.mark.parametrize("case", OUT_OF_DOMAIN)
def test_a_config_value_the_model_cannot_compute_with_is_refused(case, inputs, tmp_path, capsys):
    """Before, rope_theta 0 ran to NaN logits and said done, -10000 or rms_norm_eps -1 blamed --lr, a config of 2
    layers over weights of 3 dropped the third without a word: each refused before the build, the field named."""
    copied(inputs, tmp_path, "model")
    config = tmp_path / "model" / "config.json"
    patch, args, words = OUT_OF_DOMAIN[case]
    config.write_text(json.dumps(json.loads(config.read_text()) | patch))
    args = ["--model", "{tmp}/model", "--mode", "cpu", "--seq-len", "16", *args]
    refused(tmp_path, args, words, in_process=True, capsys=capsys)


def test_a_weight_outside_the_layers_that_the_config_has_no_place_for_is_refused(inputs, tmp_path, capsys):
    """A stray lm_head.bias beside the weights (no layer to count): one line naming it, as for a layer too many."""
    from safetensors.torch import load_file, save_file

    copied(inputs, tmp_path, "model")
    weights = tmp_path / "model" / "model.safetensors"
    tensors = load_file(weights)
    save_file(tensors | {"lm_head.bias": torch.zeros(1)}, weights, metadata={"format": "pt"})
    args = ["--model", "{tmp}/model", "--mode", "cpu", "--seq-len", "16"]
    refused(tmp_path, args, "1 weight(s) the config has no place for, such as lm_head.bias: fix", capsys=capsys)


def test_logits_or_a_loss_that_are_not_finite_end_the_run_saying_where(inputs, tmp_path, capsys):
    """A head of weights near float32's largest: every logit overflows. Inference, the first training step and the
    held-out loss before it each end the run with one line naming where, exit 1, the learning rate not blamed, and
    no result written (before, NaN logits were reported and saved, exit 0)."""
    model = LlamaForCausalLM(ol.llama_config(ol.RunConfig(preset="tiny", sizes=(("vocab_size", 300),))))
    with torch.no_grad():
        model.lm_head.weight.fill_(3e38)
    model.save_pretrained(tmp_path / "model")
    capsys.readouterr()
    outputs = ["--json", tmp_path / "r.json", "--save-output", tmp_path / "o.pt"]
    run = ["--model", tmp_path / "model", "--mode", "cpu", "--dtype", "float32", "--seq-len", "16", *outputs]
    text = ["--data", inputs / "corpus", "--tokenizer", inputs / "tokenizer", "--data-cache", tmp_path / "cache"]
    for args, words in (
        (
            [],
            "mode cpu: the logits hold infinities (the first at sequence 0, position 0): the model computes so",
        ),
        (["--train", "--no-inference", "--steps", "2"], "step 1's loss is nan: the model computes so before any"),
        (["--train", "--no-inference", *text], "the held-out loss after step 0 is nan: the model computes so"),
    ):
        code, out, err = run_main(capsys, *run, *args)
        lines = [line for line in err.splitlines() if " s  " not in line[:12]]
        assert code == 1 and len(lines) == 1 and words in lines[0] and "try a lower --lr" not in err and out == "", err
        assert sorted(p.name for p in tmp_path.iterdir()) == (["cache", "model"] if text[0] in args else ["model"])


NOT_UTF8 = os.fsdecode(b"\xff")  # a byte that is not UTF-8, as Python decodes it from argv: a lone surrogate
NOT_UTF8_TEXT = {  # text with that byte where it cannot go on, and the refusal
    "a prompt": (["--sample", f"def {NOT_UTF8}"], "--sample 'def \\udcff' holds bytes that are not UTF-8"),
    "--save-pretrained": (["--save-pretrained", f"{{tmp}}/out{NOT_UTF8}"], "out\\udcff holds bytes that are not UTF-8"),
    "--checkpoint": (["--checkpoint", f"{{tmp}}/ck{NOT_UTF8}"], "ck\\udcff holds bytes that are not UTF-8, and torch"),
    "--data-cache": (["--data-cache", f"{{tmp}}/c{NOT_UTF8}"], "c\\udcff holds bytes that are not UTF-8"),
    "--tokenizer": (["--tokenizer", f"{{tmp}}/t{NOT_UTF8}"], "t\\udcff holds bytes that are not UTF-8"),
    "--resume": (["--resume", f"{{tmp}}/t{NOT_UTF8}"], "--resume {tmp}/t\\udcff holds bytes that are not UTF-8"),
    "--model": (["--model", f"{{tmp}}/t{NOT_UTF8}"], "--model {tmp}/t\\udcff holds bytes that are not UTF-8"),
}


@pytest.mark.parametrize("case", NOT_UTF8_TEXT)
def test_text_that_is_not_utf8_is_refused_where_it_cannot_go(case, inputs, tmp_path, capsys):
    """Before, such a prompt ended in tokenizers' TypeError; torch's mapped loads, safetensors and tokenizers refuse
    such paths (a checkpoint written there would not resume): one line, the byte escaped, before torch's work."""
    (tmp_path / f"t{NOT_UTF8}").mkdir()
    args, words = NOT_UTF8_TEXT[case]
    text = ["--data", inputs / "corpus", "--tokenizer", inputs / "tokenizer", "--vocab-size", "300"]
    run = [*TRAIN, *text] if case != "--model" else [a for a in TRAIN if a not in ("--preset", "tiny")]  # its sizes
    refused(tmp_path, [*run, *args], words.replace("{tmp}", str(tmp_path)), in_process=True, capsys=capsys)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_any_bytes_and_any_terminal_encoding_end_in_no_traceback(encoding, inputs, tmp_path, capsys, monkeypatch):
    """A terminal of ASCII alone (PYTHONIOENCODING=ascii) or Latin-1 and a prompt beyond it: the results files are
    written first and the tables print, what the encoding lacks escaped (before, a UnicodeEncodeError as they printed
    lost --json and --save-output); outputs and a corpus file whose names are not UTF-8, which Python opens, are taken
    as they are."""
    shutil.copytree(inputs / "corpus", tmp_path / f"corpus{NOT_UTF8}")
    shutil.copy(inputs / "corpus" / "0.txt", tmp_path / f"corpus{NOT_UTF8}" / f"{NOT_UTF8}.txt")
    for name in ("stdout", "stderr"):
        monkeypatch.setattr(sys, name, io.TextIOWrapper(io.BytesIO(), encoding=encoding))  # errors="strict"
    outputs = ["--json", tmp_path / f"r{NOT_UTF8}.json", "--save-output", tmp_path / f"o{NOT_UTF8}.pt"]
    text = ["--data", tmp_path / f"corpus{NOT_UTF8}", "--tokenizer", inputs / "tokenizer", "--vocab-size", "300"]
    args = [*TRAIN, *text, "--data-cache", tmp_path / "cache", "--sample", "déf 中", "--sample-tokens", "2", *outputs]
    code = ol.main([str(a) for a in args])
    out, err = (stream.flush() or stream.buffer.getvalue() for stream in (sys.stdout, sys.stderr))
    shown = "cpu sample before training: 'déf 中'".encode(encoding, "backslashreplace")  # 'd\\xe9f \\u4e2d' in ASCII
    assert code == 0 and shown in out and b"Traceback" not in err, err
    assert json.loads((tmp_path / f"r{NOT_UTF8}.json").read_text())["run"]["sample"] == ["déf 中"]
    assert torch.load(tmp_path / f"o{NOT_UTF8}.pt")["training"]["cpu"]["losses"]
    assert f"of {4} file(s)".encode() in err  # the file named with the byte read too


def test_a_model_folder_it_cannot_run_as_saved_is_refused(inputs, tmp_path, capsys):
    """--model with rope settings transformers does not know, with no weights, or with weights of other names (which
    from_pretrained would draw at random): one line each, exit 2, no traceback."""
    for name in ("rope", "none", "other"):
        copied(inputs, tmp_path, "model")
        (tmp_path / "model").rename(tmp_path / name)
    config = tmp_path / "rope" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"rope_scaling": {"type": "nonsense"}}))
    args = ["--model", "{tmp}/rope", "--mode", "cpu", "--seq-len", "16"]
    refused(tmp_path, args, "transformers rejects its config.json (KeyError", in_process=True, capsys=capsys)
    (tmp_path / "none" / "model.safetensors").unlink()
    args = ["--model", "{tmp}/none", "--mode", "cpu", "--seq-len", "16"]
    refused(tmp_path, args, "no weights in it", in_process=True, capsys=capsys)
    (tmp_path / "other" / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, tmp_path / "other" / "pytorch_model.bin")
    code, out, err = run_main(capsys, "--model", tmp_path / "other", "--mode", "cpu", "--seq-len", "16")
    assert code == 2 and "Traceback" not in err and "MISSING" not in err and out == "", err
    assert "its weights lack 30 of the model's weights, such as lm_head.weight" in err.splitlines()[-1], err


NAMES = {  # outputs whose write would fail only once the run is done
    "--json ending in /": (["--json", "{tmp}/new/"], "ends with /: give a file name"),
    "--json too long to write aside": (["--json", "{tmp}/" + "j" * 250], "is too long: give one of at most"),
    "--save-pretrained too long to write aside": (
        ["--train", "--save-pretrained", "{tmp}/" + "s" * 240],
        "is too long: give one of at most 237 bytes",
    ),
}


@pytest.mark.parametrize("case", NAMES)
def test_an_output_name_it_could_not_write_is_refused_before_the_run(case, tmp_path, capsys):
    args, words = NAMES[case]
    refused(tmp_path, [*TINY, *args], words, in_process=True, capsys=capsys)


def test_a_resumed_run_goes_on_with_the_tokenizer_its_checkpoint_trained_with(inputs, tmp_path, capsys):
    """--resume with --data takes the checkpoint's tokenizer; another one (trained anew to another size) would give
    its token ids other text, and a damaged one is named: one line each, exit 2."""
    copied(inputs, tmp_path, "corpus")
    text = ["--data", tmp_path / "corpus", "--data-cache", tmp_path / "cache", "--vocab-size", "512"]
    code, _, err = run_main(capsys, *TRAIN, *text, "--train-tokenizer", "300", "--checkpoint", tmp_path / "ck")
    assert code == 0, err
    code, _, err = run_main(capsys, *TRAIN, *text, "--resume", tmp_path / "ck")
    assert code == 0 and "resumed from" in err and "note: another" not in err and "random ids" not in err, err
    code, _, err = run_main(capsys, *TRAIN, "--vocab-size", "512", "--resume", tmp_path / "ck")  # and no --data
    said = f"note: the checkpoint trained on text (--data {tmp_path / 'corpus'}); without --data, this run trains on"
    assert code == 0 and said in err, err
    code, _, err = run_main(capsys, *TRAIN, "--resume", inputs / "checkpoint")  # trained on random ids: nothing to say
    assert code == 0 and "note:" not in err, err
    code, _, err = run_main(capsys, *TRAIN, *text, "--resume", tmp_path / "ck", "--eval-fraction", "0.5")
    assert code == 0 and "note: another eval_fraction than the checkpoint's" in err, err
    code, _, err = run_main(capsys, *TRAIN, *text, "--resume", tmp_path / "ck", "--train-tokenizer", "260")
    assert code == 2 and "trained with another tokenizer than this run's" in err, err
    (tmp_path / "ck" / "tokenizer.json").write_text("{")
    code, _, err = run_main(capsys, *TRAIN, *text, "--resume", tmp_path / "ck")
    assert code == 2 and "its tokenizer does not load" in err and "it is damaged" in err, err
