"""KVStore.commit of a step's kept positions, SmolLM2's shapes at 2K: native vs the Python path, in turns."""
import statistics, time, torch
import tokenswift.model.kv as kv
from tokenswift import kernels
kernels.available()
st = kv.KVStore(num_layers=30, kv_heads=3, head_dim=64, capacity=2700, dtype=torch.bfloat16, device="cpu")
st.occupy(2048)
res = {True: [], False: []}
for i in range(400):
    for native in ((True, False) if i % 2 else (False, True)):
        kv.NATIVE_COMMIT = native
        st.length = 2048; st.staged = 8
        s = time.perf_counter(); st.commit([0, 2, 5]); res[native].append(1e3 * (time.perf_counter() - s))
print(f"commit of [0, 2, 5]: native {statistics.median(res[True]):.3f} ms, python {statistics.median(res[False]):.3f} ms")
