"""A 2K prompt prefilled in bfloat16 and in float32 (the float32 copy of the model made in
each prefill, as the runner makes it), in turns in one process. Usage: prefill_turns.py [POSITIONS [ROUNDS]]"""
import time, statistics, torch, sys
from tokenswift.model.loading import load_model
from tokenswift.model.runner import Runner
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import prompt_tokens_for
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
model, tok = load_model(ModelSpec(path="smollm2", dtype="bfloat16"))
runner = Runner(model)
prompt = torch.tensor(prompt_tokens_for(tok, ctx, None))
runner.allocate(ctx + 64)
ts = {torch.bfloat16: [], torch.float32: []}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
    for dt in (ts if r % 2 == 0 else list(ts)[::-1]):
        runner.use_prefill_dtype(dt)
        runner.reset() if hasattr(runner, "reset") else None
        s = time.perf_counter(); runner.prefill(prompt); ts[dt].append(time.perf_counter() - s)
        runner.allocate(ctx + 64)
print(ctx, {str(k): [round(x, 2) for x in v] for k, v in ts.items()})
