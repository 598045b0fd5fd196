"""A Chrome trace of one step of the gpu mode with its layers recomputed (HF's checkpointing), as offload_llama.py's
ResidentTraining runs it: 7b-8l at 16 micro-batches of 4096 tokens (the runs' default). Its kernels are to be held
against the segments' trace (calls/trace_summary.py). Usage: python3 calls/gpu_trace.py TRACE.json"""

import sys

import torch

import offload_llama as ol

run = ol.RunConfig(preset="7b-8l", train=True, grad_accum=16)
config = ol.llama_config(run)
model = ol.build_model(run, config)
trainer = ol.ResidentTraining(model, torch.device("cuda"), ol.Adam(), recompute=True)
ids = torch.randint(0, config.vocab_size, (16, run.batch_size, run.seq_len), device="cuda").unbind(0)
for _ in range(2):  # warm-up: kernels chosen, the allocator's pool grown
    trainer.step(list(ids))
torch.cuda.synchronize()
ol.profile_pass(lambda: trainer.step(list(ids)), sys.argv[1])
