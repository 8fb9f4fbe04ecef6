"""The text the default preset writes at 32K greedy (as step_stages runs it), 256 tokens, and its health."""
import sys
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift.tools.bench import preset_pipeline, prompt_tokens_for
from tokenswift.tools.contexts import auto_rope
from tokenswift.tools.interleaved import compile_model_once
ctx = int(sys.argv[1])
model, tok = load_model(ModelSpec(path="smollm2", dtype="bfloat16", rope=auto_rope(8192, ctx + 256 + 64)))
prompt = prompt_tokens_for(tok, ctx, None)
compile_model_once(model, tok, trees=True)
pipe = preset_pipeline("tokenswift", model, tok, heads="auto", overrides={"model": {"compile": True}, "sampling": {"greedy": True}})
result = pipe.generate(prompt, 256, seed=0, ignore_eos=True)
print("PROMPT END:", repr(tok.decode(prompt[-200:])))
print("TEXT:", repr(tok.decode(result.tokens)))
print({k: getattr(result, k) for k in dir(result) if not k.startswith("_") and isinstance(getattr(result, k), (int, float))})
