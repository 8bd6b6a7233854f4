#!/usr/bin/env bash
# The learner on one GPU, in one command that fits one lent-device call (about 8 minutes on an H100/H200; no
# downloads: every model is built from its config on the device). Run it whenever a session is lent a GPU:
#
#     bash scripts/gpu_check.sh            # results in $OUT (the device call's folder) or /tmp/gpu_check
#
# What it runs, the open goals first (each with its own time limit, cut to what the deadline leaves; past the GPU
# runs' deadline the rest of them is skipped, and the publish bench keeps its own share of the call):
#   1. Qwen3-4B shape, 64 x (256 + 2,048), compiled, 10,240-token micro-batches without checkpointing (what
#      `plan-memory --compile --device-gib 139.8` suggests), one more step profiled, and the version's export;
#   2. one process, Qwen3-1.7B shape, 64 x (256 + 1,024), compiled layers (--compile): step time, tokens/s,
#      MFU, peak memory against `plan-memory`, log-prob error against fp32;
#   3. variable-length completions (128-1,920 tokens, the same mean) on the 1.7B shape, compiled: packing, not
#      padding, and no recompilation for a new layout;
#   4. the 1.7B shape under torchrun at world size 1 (FSDP2, NCCL), compiled: the sharded trainer's CUDA path;
#   5. the 4B shape at 12,288-token micro-batches (the largest packs 10,752 tokens), expandable allocator segments;
#   6. the learner process end to end on CUDA: learner + a scripted rollout client over real HTTP through 3 steps,
#      publish, checkpoint, --resume (scripts/gpu_e2e.py; vLLM cannot be installed on the lent machine), the
#      learner sharded at world size 1 (torchrun, NCCL; each rank loads its shards from the meta device);
#   7. the 1.7B shape eager (no --compile), for the difference compiling makes;
#   8. LoRA on CUDA (1.7B shape), and a checkpoint's seconds;
#   9. the previous trainer (a copy of its echo2cli in .baseline/, when present) on step 7's setting, for a
#      same-run baseline: mkdir .baseline && git archive COMMIT echo2cli | tar -x -C .baseline (git-ignored;
#      carry it with .whl);
#  10. scripts/bench_publish.py on the Qwen3-8B shape (16.4 GB versions) on all 16 cores: the publish and a
#      worker's rebuild and verify, against a read + write of the file (CPU and disk only; 50 GB of disk).
# A compiled run's first step compiles (about 40 s on an H200); each run takes 4 steps, the first a warm-up.
# The packages the lent machine lacks (pydantic, fastapi, uvicorn, libtorrent, zstandard, blake3, ...) travel as
# wheels in .whl/ (../shared/FIELD-NOTES.md says how to fetch them). Results: $OUT/results.jsonl (one JSON line per run) and
# $OUT/log.txt; a summary table at the end.
#
# Dry run on a CPU box (tiny shapes, minutes): GPU_CHECK_DRY=1 PYTHON=.venv/bin/python bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/log.txt
RESULTS=$OUT/results.jsonl
DEADLINE=${GPU_CHECK_DEADLINE_S:-560}  # the whole check
PUBLISH_S=${GPU_CHECK_PUBLISH_S:-200}  # of which the publish bench's share, at the end (0: no publish bench)
GPU_DEADLINE=$(( DEADLINE - PUBLISH_S ))
START=$SECONDS
if [ -d .whl ] && [ -z "${GPU_CHECK_DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: the wheels in .whl/ do not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
DRY=()
if [ -n "${GPU_CHECK_DRY:-}" ]; then  # later flags win: every model tiny, every batch small
  DRY=(--shape tiny --groups 2 --group-size 4 --prompt-tokens 16 --completion-tokens 64 --micro-batch-tokens 256)
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
"$PY" -c "import numpy, torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)" \
  | tee -a "$LOG"
"$PY" -c "import numba; print('numba', numba.__version__)" 2>&1 | tail -n 1 | tee -a "$LOG"  # the delta coder's loops

run() {  # run NAME LIMIT_S COMMAND...: one check, its output into the log, cut to the deadline or skipped past it
  local name=$1 limit=$2
  shift 2
  local left=$(( GPU_DEADLINE - (SECONDS - START) ))
  if (( left < 30 )); then
    echo "== $name: skipped (past the ${GPU_DEADLINE}s deadline of the GPU runs)" | tee -a "$LOG"
    return
  fi
  (( limit > left )) && limit=$left
  echo "== $name ($(( SECONDS - START ))s in)" | tee -a "$LOG"
  timeout "$limit" "$@" "${DRY[@]}" >>"$LOG" 2>&1
  local rc=$?
  (( rc == 0 )) || echo "!! $name failed (exit $rc); its last lines:" | tee -a "$LOG"
  (( rc == 0 )) || tail -n 15 "$LOG"
}

BENCH=("$PY" scripts/bench_learner_gpu.py --json "$RESULTS")
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node=1 scripts/bench_learner_gpu.py --json "$RESULTS")
LONG=(--shape 4b --completion-tokens 2048)
CKPT_DIR=$(mktemp -d /tmp/gpu-check-ckpt-XXXX)
trap 'rm -rf "$CKPT_DIR" /tmp/bench-gpu-* /tmp/echo2-publish-*' EXIT

COMPILED=(--compile --steps 4)
run "4b compiled, no checkpointing, 10240" 200 "${BENCH[@]}" "${LONG[@]}" --micro-batch-tokens 10240 "${COMPILED[@]}" \
  --profile "$OUT/profile-4b.txt" --export
run "1.7b compiled" 110 "${BENCH[@]}" --shape 1.7b "${COMPILED[@]}" --logp-error
run "1.7b compiled, variable lengths" 110 env TORCH_LOGS=recompiles "${BENCH[@]}" --shape 1.7b "${COMPILED[@]}" --variable
run "1.7b torchrun world 1, compiled" 150 "${TORCHRUN[@]}" --shape 1.7b "${COMPILED[@]}"
run "4b compiled, no checkpointing, 12288" 150 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  "${BENCH[@]}" "${LONG[@]}" --micro-batch-tokens 12288 "${COMPILED[@]}"
DRY_E2E=("${DRY[@]}")
DRY=()  # the end-to-end check has its own small model
run "learner end to end" 200 "$PY" scripts/gpu_e2e.py --out /tmp/gpu-e2e --timeout 180 --sharded
DRY=("${DRY_E2E[@]}")
cp /tmp/gpu-e2e/figures.json "$OUT/e2e_figures.json" 2>/dev/null || tail -n 30 /tmp/gpu-e2e/*.log 2>/dev/null | tee -a "$LOG"
run "1.7b eager" 80 "${BENCH[@]}" --shape 1.7b
run "1.7b lora, checkpoint" 100 "${BENCH[@]}" --shape 1.7b --lora --checkpoint "$CKPT_DIR"
if [ -d .baseline/echo2cli ]; then
  PYTHONPATH=${PYTHONPATH/$PWD/$PWD/.baseline} run "1.7b previous trainer" 120 "${BENCH[@]}" --shape 1.7b
fi
left=$(( DEADLINE - (SECONDS - START) ))
if (( PUBLISH_S > 0 && left < 30 )); then
  echo "== publish bench: skipped (${left}s left of the ${DEADLINE}s deadline)" | tee -a "$LOG"
elif (( PUBLISH_S > 0 )); then  # CPU and disk only: what is left of the deadline (timeout 0 would mean none)
  shape=8b cores=$(nproc)
  [ -n "${GPU_CHECK_DRY:-}" ] && shape=tiny cores=1
  echo "== publish bench, $shape on $cores cores ($(( SECONDS - START ))s in, ${left}s left)" | tee -a "$LOG"
  timeout "$left" "$PY" scripts/bench_publish.py --shape "$shape" --cores "$cores" --dir /tmp \
    --json "$OUT/publish-$shape.json" >>"$LOG" 2>&1 || echo "!! publish bench failed or ran out of time (exit $?)" | tee -a "$LOG"
fi

echo "== summary ($(( SECONDS - START ))s)" | tee -a "$LOG"
"$PY" - "$RESULTS" <<'EOF' | tee -a "$LOG"
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except FileNotFoundError:
    rows = []
print(f"{'run':44s} {'step s':>7s} {'tok/s':>8s} {'MFU':>6s} {'peak':>6s} {'plan':>6s} {'export':>6s} {'ckpt':>6s}")
for r in rows:
    name = (f"{r['shape']} {'torchrun ' if r['sharded'] else ''}{'lora ' if r['lora'] else ''}"
            f"{'compiled ' if r.get('compile') else ''}"
            f"{'var ' if r['variable'] else ''}{'ckpt ' if r['activation_checkpointing'] else ''}"
            f"mb{r['micro_batch_tokens']} {'BASELINE ' if r['baseline_trainer'] else ''}{r.get('attention', '')}")
    print(f"{name:44s} {r['step_s']:7.2f} {r['tokens_per_s']:8d} {100 * r['mfu']:5.1f}% "
          f"{r.get('peak_gib', 0):6.1f} {r.get('plan_gib', 0):6.1f} {r.get('export_s', 0):6.1f} {r.get('checkpoint_s', 0):6.1f}"
          + (f"  logp err max {r['logp_err_max']} mean {r['logp_err_mean']}" if 'logp_err_max' in r else ''))
EOF
