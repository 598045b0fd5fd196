"""Peers of offload_llama.py on the same model and batch, timed and measured as it measures its own modes.

- Training: PyTorch FSDP2, `fully_shard` with `CPUOffloadPolicy` on one GPU: float32 parameters, gradients and
  Adam state in pinned CPU memory; each decoder layer's parameters are copied in and cast to the compute dtype
  before it runs (again for its backward), and its float32 gradients copied out; the fused CPU Adam steps once the
  backward pass has ended. The same recipe as offload_llama.py's offloaded training, without its overlap of the
  CPU Adam with the backward pass.
- Training: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU (`offload_param`,
  `offload_optimizer`), and ZeRO-2 with the optimizer offloaded: float32 masters and Adam state in pinned CPU memory,
  stepped by DeepSpeed's CPU Adam (built on first use, about a minute) with torch.optim.Adam's L2 weight decay.
- Inference: Hugging Face accelerate's `cpu_offload`: the weights stay in (pageable) CPU memory, and a hook on each
  module copies its weights in just before it runs, on the compute stream.

Report tooling: offload_llama.py imports none of them. DeepSpeed is not a requirement: where it is not installed,
its rows say so. The GPU machine has no network, so it goes there as wheels (`wheels/`, git-ignored), made on a
machine that reaches the package index:

    DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w wheels
    pip download -d wheels --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
        --implementation cp hjson pydantic einops msgpack py-cpuinfo

and installed there with `pip install --no-index --no-deps --target DIR wheels/*.whl` and `PYTHONPATH=DIR`
(report/run_benchmarks.sh does it). The flags after this script's own are offload_llama.py's (model, batch, dtype,
--steps, --warmup, --repeat, Adam):

    python3 report/peers.py --json peers_bf16.json --dtype bfloat16

Under torchrun, the DeepSpeed peers train data-parallel, one rank per GPU, each on its share of the step's
micro-batches (as offload_llama.py's ranks do: give it --mode overlapped --train and a --grad-accum the ranks divide);
rank 0 prints and writes, with every rank's peaks:

    torchrun --nproc-per-node 2 report/peers.py --peers zero3 --mode overlapped --train --grad-accum 2 --json p.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload_llama as ol  # noqa: E402

PEERS = ("accelerate", "fsdp2", "zero3", "zero2")
NAMES = {
    "accelerate": "accelerate cpu_offload",
    "fsdp2": "FSDP2 fully_shard + CPUOffloadPolicy",
    "zero3": "DeepSpeed ZeRO-3, parameters and optimizer offloaded",
    "zero2": "DeepSpeed ZeRO-2, optimizer offloaded",
}


def accelerate_inference(model, input_ids, run: ol.RunConfig) -> dict:
    """One forward pass with accelerate's cpu_offload, and whether its logits equal the resident model's."""
    from accelerate import cpu_offload

    device = torch.device("cuda")
    ids = input_ids.to(device)
    with torch.inference_mode():
        _, reference = ol.infer_resident(model, input_ids, device, run, model.config)
        ol.free_gpu_memory()
        offloaded = cpu_offload(copy.deepcopy(model), execution_device=device)  # moves its copy's weights to meta
        ol.reset_peak_memory(device)
        ms, logits = ol.median_ms(lambda: ol.logits_of(offloaded, ids), device, run.warmup, run.repeat)
        return {
            "time_ms": ms,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
            "peak_host_bytes": ol.peak_host_rss(),
            "equal_to_gpu": torch.equal(logits.cpu(), reference),
        }


class Fsdp2Training:
    """FSDP2 with CPU offload on a one-process group: a trainer for offload_llama.train_steps."""

    def __init__(self, model, run: ol.RunConfig):
        """A float32 copy of `model`, one fully_shard group per decoder layer and one for the rest, and its Adam."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.model = copy.deepcopy(model).float()  # the float32 masters; FSDP moves them to pinned CPU memory
        self.model.requires_grad_()
        mixed = MixedPrecisionPolicy(param_dtype=run.torch_dtype, reduce_dtype=torch.float32)
        for layer in self.model.model.layers:  # one group per decoder layer, as offload_llama.py streams them
            fully_shard(layer, mp_policy=mixed, offload_policy=CPUOffloadPolicy())
        fully_shard(self.model, mp_policy=mixed, offload_policy=CPUOffloadPolicy())  # embeddings, norm, head
        self.optimizer = run.adam.optimizer(list(self.model.parameters()))  # fused torch.optim.Adam, on the CPU

    def step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One training step: forward and backward of each micro-batch, then the CPU Adam; the mean loss."""
        losses = []
        for ids in micro_batches:
            loss = self.model(ids, labels=ids, use_cache=False).loss
            (loss / len(micro_batches)).backward()
            losses.append(loss.detach())
        self.optimizer.step()
        self.optimizer.zero_grad()
        return ol.mean_loss(losses)

    def finish(self) -> None:  # the trainer interface's end (offload_llama's stops its CPU Adam): nothing here
        ...


def fsdp2_training(model, input_ids, run: ol.RunConfig) -> dict:
    """Training steps with FSDP2 and CPUOffloadPolicy in a one-process group: train_steps' results and the peaks."""
    import torch.distributed as dist

    device = torch.device("cuda")
    torch.cuda.set_device(0)
    # one process, world size 1: an in-memory store, no network
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        micro_batches = [ids.to(device) for ids in input_ids.chunk(run.grad_accum)]
        ol.log(f"FSDP2 + CPUOffloadPolicy: training, {run.steps} steps of {input_ids.numel()} tokens ...")
        ol.reset_peak_memory(device)
        trainer = Fsdp2Training(model, run)
        result = ol.train_steps(trainer, micro_batches, run, keep_grads=False)
        del result["grads"]
        return {
            **result,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
            "peak_host_bytes": ol.peak_host_rss(),
        }
    finally:
        dist.destroy_process_group()


class DeepSpeedTraining:
    """DeepSpeed ZeRO (stage 3 or 2) with CPU offload in one process: a trainer for offload_llama.train_steps."""

    def __init__(self, model, run: ol.RunConfig, stage: int):
        """The engine over a copy of `model` (DeepSpeed keeps its float32 masters and Adam state on the CPU)."""
        import deepspeed

        offload = {"device": "cpu", "pin_memory": True}
        zero = {"stage": stage, "offload_optimizer": offload} | ({"offload_param": offload} if stage == 3 else {})
        adam = {"lr": run.lr, "betas": list(run.betas), "eps": run.eps, "weight_decay": run.weight_decay}
        config = {
            "train_micro_batch_size_per_gpu": run.batch_size,
            "gradient_accumulation_steps": run.grad_accum // run.ranks.world,  # each rank's share of the step's
            "bf16": {"enabled": run.dtype == "bfloat16"},
            "fp16": {"enabled": run.dtype == "float16"},
            "zero_optimization": zero,
            "optimizer": {"type": "Adam", "params": adam | {"adam_w_mode": False}},  # torch.optim.Adam's L2 decay
            "gradient_clipping": run.clip_grad_norm or 0.0,
            "steps_per_print": 2**31,
        }
        module = copy.deepcopy(model)
        if stage == 3:  # partitioned into CPU memory a parameter at a time: initialize() would first move it all in
            deepspeed.zero.Init(module=module, config_dict_or_path=config)
        self.engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
        self.ranks = run.ranks

    def step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One training step: forward and backward of each micro-batch (DeepSpeed divides the loss by their count),
        the optimizer stepping at the last; the mean loss."""
        losses = []
        for ids in micro_batches:
            loss = self.engine(ids, labels=ids, use_cache=False).loss
            self.engine.backward(loss)
            self.engine.step()  # the optimizer steps at the gradient accumulation boundary
            losses.append(loss.detach())
        return ol.mean_loss(losses, self.ranks)

    def finish(self) -> None:
        """Free the engine (its hooks, pinned buffers and GPU copies), which DeepSpeed's global state would keep alive
        into the next peer's run, and undo ZeRO-3's process-wide swap of F.linear."""
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patched
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

        self.engine.destroy()
        parameter_offload.FWD_MODULE_STACK.clear()
        cached = getattr(Coordinator, "_PartitionedParameterCoordinator__params_to_release", None)
        for cell in getattr(cached, "__closure__", None) or ():  # an lru_cache under DeepSpeed's nvtx wrapper
            getattr(cell.cell_contents, "cache_clear", lambda: None)()
        if hasattr(Patched, "linear_bk"):
            torch.nn.functional.linear = Patched.linear_bk
        del self.engine


def deepspeed_training(model, input_ids, run: ol.RunConfig, stage: int) -> dict:
    """Training steps with DeepSpeed ZeRO-`stage` CPU offload in a one-process group, or under torchrun in the ranks'
    group, each rank on its share of the micro-batches: train_steps' results and the peaks (every rank's, gathered);
    {'missing': why} where DeepSpeed is not installed."""
    try:
        import deepspeed
    except ImportError as e:
        ol.log(f"DeepSpeed ZeRO-{stage}: not installed ({e}), not measured")
        return {"missing": f"DeepSpeed is not installed ({e})"}
    ranks = run.ranks
    device = torch.device("cuda", ranks.local_rank)
    torch.cuda.set_device(device)
    if not ranks.several:  # one process, world size 1, over loopback: the rendezvous torchrun would set up
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    deepspeed.init_distributed("nccl", auto_mpi_discovery=False)  # once: nothing when a group is up; main ends it
    micro_batches = [ids.to(device) for ids in ranks.share(list(input_ids.chunk(run.grad_accum)))]
    ol.log(f"DeepSpeed ZeRO-{stage} offload: training, {run.steps} steps of {input_ids.numel()} tokens ...")
    ol.reset_peak_memory(device)
    trainer = DeepSpeedTraining(model, run, stage)
    try:
        result = ol.train_steps(trainer, micro_batches, run, keep_grads=False)
    finally:
        trainer.finish()
    del result["grads"]
    peaks = {"peak_gpu_bytes": torch.cuda.max_memory_allocated(device), "peak_host_bytes": ol.peak_host_rss()}
    result = ol.rank_peaks(ranks, result | peaks, ol.param_count(model.config))
    return result | {"deepspeed": deepspeed.__version__}


def table(results: dict, run: ol.RunConfig, tokens: int) -> str:
    """The peers' results as a markdown table."""
    what = f"{run.preset}, {run.dtype}, {tokens} tokens"
    rows = [(NAMES[p], r) for p, r in results.items()]
    return "\n".join(
        ol.markdown(
            f"Peers ({what})",
            [
                ("run", ":---:"),
                ("time (ms)", "---:"),
                ("peak GPU (GiB)", "---:"),
                ("peak host RSS (GiB)", "---:"),
                ("check", "---"),
            ],
            rows,
            lambda label, r: (
                ["training step", "", "", "", r["missing"]]
                if "missing" in r
                else [
                    "inference" if "equal_to_gpu" in r else "training step",
                    f"{r['time_ms']:.1f}",
                    ol.gib(r["peak_gpu_bytes"]),
                    ol.gib(r["peak_host_bytes"]),
                    f"logits == gpu: {'yes' if r['equal_to_gpu'] else 'NO'}"
                    if "equal_to_gpu" in r
                    else f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                ]
            ),
        )
    )


def main(argv=None) -> int:
    """The command line: --peers and --json, then offload_llama.py's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="other flags: offload_llama.py's")
    p.add_argument("--peers", default=",".join(PEERS), help="a comma-separated list of " + ", ".join(PEERS))
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args, rest = p.parse_known_args(argv)
    peers = args.peers.split(",")
    if not set(peers) <= set(PEERS):
        p.error(f"--peers {args.peers}: choose from {', '.join(PEERS)}")
    if not torch.cuda.is_available():
        p.error("the peers offload to a CUDA GPU, and torch.cuda.is_available() is False")
    run = ol.parse_args(rest)  # offload_llama.py's flags, with its checks (under torchrun, the ranks' too)
    if run.ranks.several and not set(peers) <= {"zero3", "zero2"}:
        p.error(f"--peers {args.peers}: under torchrun, the DeepSpeed peers alone train (zero3, zero2)")
    if run.ranks.several:
        # torchrun sets OMP_NUM_THREADS=1: DeepSpeed's CPU Adam would run on one core
        torch.set_num_threads(max(1, ol.host_cores() // run.ranks.local_world))
    config = ol.model_config(run)
    model = ol.load_model(dataclasses.replace(run, mode="gpu"), config)  # whole: a peer trains the CPU model
    input_ids = ol.random_input_ids(run, config.vocab_size)
    results = {}
    if "accelerate" in peers:
        ol.log(f"accelerate cpu_offload: inference over {input_ids.numel()} tokens ...")
        results["accelerate"] = accelerate_inference(model, input_ids, run)
        ol.free_gpu_memory()
    train_ids = ol.random_input_ids(run, config.vocab_size, run.grad_accum)
    if "fsdp2" in peers:
        results["fsdp2"] = fsdp2_training(model, train_ids, run)
        ol.free_gpu_memory()
    for stage in (3, 2):
        if f"zero{stage}" in peers:
            results[f"zero{stage}"] = deepspeed_training(model, train_ids, run, stage)
            ol.free_gpu_memory()
    if torch.distributed.is_initialized():  # DeepSpeed's group
        torch.distributed.destroy_process_group()
    if run.ranks.rank:
        return 0
    print(table(results, run, input_ids.numel()))
    if args.json:
        report = {
            **ol.environment(),
            "peers_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            "run": {**dataclasses.asdict(run), "peers": peers},
            "tokens": input_ids.numel(),
            "parameters": ol.param_count(config),
            "config": json.loads(config.to_json_string()),
            "peers": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
