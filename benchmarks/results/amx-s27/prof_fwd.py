"""Profile a compiled one-token forward at 2K on this machine."""
import statistics, sys, time, logging
import torch
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.spec import ModelSpec
context = 2048
model, _ = load_model(ModelSpec(path="smollm2", dtype="bfloat16"))
runner = Runner(model)
runner.allocate(context + 600)
runner.use_compiled(True)
runner.prefill(torch.randint(0, runner.vocab_size, (context,)))
tok = torch.tensor([5])
def run():
    return runner.forward(tok, logits_rows=None)
for _ in range(5): run()
ts=[]
for _ in range(30):
    s=time.perf_counter(); run(); ts.append(1000*(time.perf_counter()-s))
print("forward median", statistics.median(ts))
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20): run()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
