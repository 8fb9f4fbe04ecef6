"""A prototype: SmolLM2-135M's 210 Q4_1 weights read from the GGUF (5 bits a weight,
dequantized in the product), against the bfloat16 few-rows kernel: the outputs compared
bit for bit for 1-5 rows, then the 210 products timed (flush: 64 MB read between layers).
Builds q4_1_products.cpp beside it. Not part of the library (see README.md)."""
import glob, sys, time, statistics, numpy as np, torch, gguf
from pathlib import Path
from torch.utils import cpp_extension
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
import tokenswift.kernels as kernels
torch.set_num_threads(2); kernels.available()
ext = cpp_extension.load("q4proto", [str(Path(__file__).with_name("q4_1_products.cpp"))], extra_cflags=["-O3", "-march=native"], verbose=False)
model, _ = load_model(ModelSpec(path="smollm2", dtype="bfloat16"))
p = str(__import__('tokenswift.model.loading', fromlist=['PACKAGED_MODELS']).PACKAGED_MODELS['smollm2'].locate())
r = gguf.GGUFReader(p)
names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
params = dict(model.named_parameters())
def perm(w, n_head):
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
pairs = []  # (W bf16, packed q4, O)
for t in r.tensors:
    if t.tensor_type.name != "Q4_1": continue
    _, layer, kind, _ = t.name.split(".")
    W = params[f"model.layers.{layer}.{names[kind]}.weight"].detach()
    O, K = W.shape; NB = K // 32
    blocks = np.asarray(t.data).reshape(O, NB, 20)
    if kind == "attn_q": blocks = perm(blocks, 9)
    if kind == "attn_k": blocks = perm(blocks, 3)
    G = (O + 15) // 16
    pad = np.zeros((G * 16 - O, NB, 20), np.uint8)
    blocks = np.concatenate([blocks, pad]).reshape(G, 16, NB, 20)
    d = blocks[..., 0:2].transpose(0, 2, 1, 3).reshape(G, NB, 32)
    m = blocks[..., 2:4].transpose(0, 2, 1, 3).reshape(G, NB, 32)
    qs = blocks[..., 4:]                          # [G, 16, NB, 16]: byte j: lo = k j, hi = k j+16
    q = np.concatenate([qs & 0xF, qs >> 4], -1)   # [G, 16, NB, 32] values of k 0..31
    qq = q.reshape(G, 16, NB, 16, 2).transpose(0, 2, 3, 1, 4)  # [G, NB, pair, output, k of the pair]
    # byte i of a pair: lo = (output i // 2, k + i % 2), hi = (output 8 + i // 2, k + i % 2)
    qp = (qq[:, :, :, :8, :].reshape(G, NB, 16, 16) | (qq[:, :, :, 8:, :].reshape(G, NB, 16, 16) << 4)).reshape(G, NB, 256)
    packed = torch.from_numpy(np.ascontiguousarray(np.concatenate([d, m, qp], -1)))
    pairs.append((W, packed, O))
print("q4 bytes", sum(p.numel() for _, p, _ in pairs) / 1e6, "MB; bf16", sum(W.numel() * 2 for W, _, _ in pairs) / 1e6)
# exactness
for n in (1, 2, 3, 4, 5):
    bad = 0
    for W, pk, O in pairs:
        x = torch.randn(n, W.shape[1]).bfloat16()
        if not torch.equal(ext.q4_linear(x, pk, O), kernels.few_rows_linear(x, W, None)): bad += 1
    print("rows", n, "mismatched products", bad, "of", len(pairs))
junk = torch.ones(64 * 1024 * 1024 // 4)
def run(n, q4, flush):
    xs = {k: torch.randn(n, k).bfloat16() for k in (576, 1536)}
    ts = []
    for _ in range(10):
        tot = 0
        for li in range(30):
            if flush: junk.sum()
            t0 = time.perf_counter()
            for W, pk, O in pairs[li * 7: li * 7 + 7]:
                ext.q4_linear(xs[W.shape[1]], pk, O) if q4 else kernels.few_rows_linear(xs[W.shape[1]], W, None)
            tot += time.perf_counter() - t0
        ts.append(tot)
    return statistics.median(ts[2:]) * 1000
for rep in range(2):
    for flush in (True, False):
        print("flush" if flush else "warm ", " ".join(f"{n}: bf16 {run(n, False, flush):.2f} q4 {run(n, True, flush):.2f}" for n in (1, 2, 4)), flush=True)
