#!/usr/bin/env bash
# One prepared run on a lent GPU machine (bare, offline, its own python3 with torch):
# the CUDA tests, the side-by-side benchmark, forward costs up to 100K context, and
# head training on the GPU — each step time-boxed so the whole run ends in BUDGET s.
#
#   MODEL=/path/SmolLM2-135M-Instruct.Q4_1.gguf DATA=/path/pg_books.jsonl \
#   WHEELS=dir-with-transformers-and-gguf-wheels OUT=results-dir bash benchmarks/gpu_session.sh
#
# Everything lands in $OUT (at most 13 files): session.log, forward_cost.md,
# forward_cost_compiled.md, interleaved.json/.md (eager vs compiled), bench.json/.md/.png,
# heads.safetensors and training.json; trees/: the compile calibration with tree sizes
# (calibrate.md) and eagle vs ar with compiled trees (interleaved.json/.md).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENSWIFT_CACHE=/tmp/tokenswift-cache
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-520}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LOG="$OUT/session.log"
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
say() { echo "== [$(($(date +%s) - start)) s] $*" | tee -a "$LOG"; }

if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl >>"$LOG" 2>&1 || { say "wheel install failed"; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1

say "CUDA tests"
timeout $(( $(left) < 90 ? $(left) : 90 )) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py >>"$LOG" 2>&1
say "tests exit $?"

say "bench --quick on cuda"
timeout $(( $(left) < 200 ? $(left) : 200 )) python3 -m tokenswift bench --model "$MODEL" --device "$DEVICE" --quick --out "$OUT" >>"$LOG" 2>&1
say "bench exit $?"

say "compiled one-token forwards on cuda (issue 19: <= 5 ms at 2K)"
timeout $(( $(left) < 60 ? $(left) : 60 )) python3 benchmarks/forward_cost.py --model "$MODEL" --device "$DEVICE" --compile \
    --contexts 2048 32768 --nodes 0 15 --view 4096 --repeats 5 --no-prefill >"$OUT/forward_cost_compiled.md" 2>>"$LOG"
say "compiled forward costs exit $?"

say "ar and tokenswift, eager vs compiled, in turns on cuda"
timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m tokenswift bench --interleaved --methods ar,tokenswift --compile both \
    --model "$MODEL" --device "$DEVICE" --prompt-tokens 2048 --new-tokens 512 --seeds 0 --out "$OUT" >>"$LOG" 2>&1
say "compiled bench exit $?"

say "compiled tree verify forwards on cuda (issue 27): eagle vs ar, compiled, in turns"
mkdir -p "$OUT/trees"
timeout $(( $(left) < 150 ? $(left) : 150 )) python3 -m tokenswift calibrate --model "$MODEL" --device "$DEVICE" --compile \
    >"$OUT/trees/calibrate.md" 2>>"$LOG"
say "compile calibration (trees) exit $?"
timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m tokenswift bench --interleaved --methods ar,eagle --compile on --greedy \
    --model "$MODEL" --device "$DEVICE" --prompt-tokens 2048 --new-tokens 512 --seeds 0 --out "$OUT/trees" >>"$LOG" 2>&1
say "compiled-trees bench exit $?"

say "forward costs on cuda"
timeout $(( $(left) < 50 ? $(left) : 50 )) python3 benchmarks/forward_cost.py --model "$MODEL" --device "$DEVICE" \
    --contexts 2048 8192 32768 100000 --nodes 0 15 63 100 --view 4096 --repeats 5 >"$OUT/forward_cost.md" 2>>"$LOG"
say "forward costs exit $?"

# Head training: measure the step time with a short run, then size the real run to what is left.
TRAIN=(--model "$MODEL" --device "$DEVICE" --data "$DATA" --seq-len 512 --batch 32 --positions 0 --lr 5e-3 --warmup 100)
say "train-heads calibration"
timeout 60 python3 -m tokenswift train-heads "${TRAIN[@]}" --steps 20 --out /tmp/calibration >>"$LOG" 2>&1
per_step=$(python3 -c "import json; print(json.load(open('/tmp/calibration/training.json'))['wall_seconds'] / 20)" 2>>"$LOG" || echo 1)
steps=$(python3 -c "print(max(100, min(4000, int(($(left) - 45) / $per_step))))")
say "train-heads: $per_step s/step, $steps steps"
timeout $(( $(left) - 5 )) python3 -m tokenswift train-heads "${TRAIN[@]}" --steps "$steps" --checkpoint-every 200 --out /tmp/heads >>"$LOG" 2>&1
say "train-heads exit $?"
cp /tmp/heads/training.json /tmp/heads/*.safetensors "$OUT"/ 2>>"$LOG" || cp /tmp/heads/checkpoint* "$OUT"/ 2>>"$LOG"
say "done"
