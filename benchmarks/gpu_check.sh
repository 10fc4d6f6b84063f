#!/usr/bin/env bash
# `make gpu-check`: the whole check of one machine with one GPU, in about 8 minutes, each part under its own time
# limit, in this order (a run cut short still has the first parts):
#   suite     the GPU suite (tests/gpu): patterns against plain PyTorch in fp32/bf16/fp16 at ZeRO 0-3, GAN,
#             distillation, GradCache, EMA, `gathered`, a weights_only resume, the CLI configs
#   syncs     host-device syncs per step under torch.cuda.set_sync_debug_mode, the strategy against a raw loop
#   memory    peak GPU memory of a distillation: teacher at ZeRO-0 against ZeRO-3, student offloaded or not
#   overhead  step time against raw DeepSpeed and Lightning's DeepSpeedStrategy, transformers in bf16
# The report is $OUT/report.md (OUT: outputs/gpu-check where unset), each part's log beside it (five files in all;
# the JSON of syncs and overhead under outputs/gpu-check).
# The machine needs python3 with torch (CUDA), Lightning and pytest; what it lacks (DeepSpeed and what it imports,
# jsonargparse, pytest-xdist...) comes as wheels from .gpu/whl, which `make gpu-wheels` fills on a machine that reaches
# PyPI (`make gpu-wheels-proof` checks the folder is complete before a GPU is spent on it).
set -u
OUT=${OUT:-outputs/gpu-check}
PY=${GPU_PYTHON:-python3}
mkdir -p "$OUT"
REPORT=$OUT/report.md
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if compgen -G ".gpu/whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site \
        .gpu/whl/*.whl || exit
    export PYTHONPATH=/tmp/gpu-site:$PWD
fi

# part NAME SECONDS COMMAND...: run COMMAND with its output in $OUT/NAME.log; its table rows and end in the report.
part() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    {
        echo
        echo "## $name: exit $rc after $(($(date +%s) - start)) s (limit $limit s)"
        echo
        grep -E '^\|' "$OUT/$name.log"
        # each test's verdict as it finished (pytest -v), so a part cut short still reports what passed
        grep -oE '(PASSED|FAILED|ERROR|SKIPPED) tests/[^ ]+|tests/[^ ]+ (PASSED|FAILED|ERROR|SKIPPED)' "$OUT/$name.log" | sort -u
        grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped)|Error:' "$OUT/$name.log" | tail -40
    } >>"$REPORT"
}

{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c "import torch, lightning, deepspeed, sys; print('Python', sys.version.split()[0], '| torch', \
torch.__version__, '| CUDA', torch.version.cuda, '| Lightning', lightning.__version__, '| DeepSpeed', deepspeed.__version__)"
} >"$REPORT" 2>&1

XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
# shellcheck disable=SC2086
part suite 150 $PY -m pytest -m gpu tests/gpu -rfEs -v -p no:cacheprovider $XDIST --durations=10
part syncs 70 $PY benchmarks/syncs.py --cases gan distill single --stages 0 1 2 3 \
    --precisions bf16-mixed 16-mixed --out outputs/gpu-check/syncs.json
RUN="$PY -m torch.distributed.run --nproc-per-node 1"
TEACHER="--teacher-hidden 4096 --teacher-layers 12 --student-hidden 16384"
# shellcheck disable=SC2086
part memory 110 bash -c "echo '| precision | teacher | student | sizes | fit peak MiB | peak while the teacher runs MiB |'
    echo '|---|---|---|---|---|---|'
    $RUN benchmarks/memory.py gpu-peak --teacher-stage 0 $TEACHER
    $RUN benchmarks/memory.py gpu-peak --teacher-stage 3 $TEACHER
    $RUN benchmarks/memory.py gpu-peak --teacher-stage 3 $TEACHER --offload"
# shellcheck disable=SC2086
part overhead 140 $RUN benchmarks/overhead.py --device cuda --precision bf16-mixed --arch transformer \
    --case distill gan --stage 3 2 0 --rounds 3 --steps 10 --warmup 3 --out outputs/gpu-check/overhead
cat "$REPORT"
