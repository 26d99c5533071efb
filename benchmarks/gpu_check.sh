#!/usr/bin/env bash
# The prepared GPU check: run it first whenever a CUDA machine is at hand (about 9 minutes on one H200).
#
#   bash benchmarks/gpu_check.sh OUT_DIR [WHEEL_DIR] [SECONDS]
#
# From the repository root. The machine needs no internet: WHEEL_DIR (default: wheels) holds wheels
# carried along (Python 3.12: liger-kernel for the rotation comparison, timm if the machine's differs
# from the tested one); only those whose distribution is missing or at another version are installed,
# into a private folder put first on PYTHONPATH. Writes to OUT_DIR, each stage under its own time limit
# so that a hang in one still leaves the others' results:
#   gpu_check.log  everything, in order (versions, GPU, each stage's output)
#   pytest.log     the fused kernels against the reference on CUDA: tests/test_cuda_fused.py (marker
#                  cuda) and tests/test_triton_rotary.py (the interpreter tests, here compiled)
#   numerics.md    kind x dtype x shape -> max relative difference, output and gradients
#   fused_selfcheck.md  the cost of the fused kernels' first-launch check under 'auto' and
#                  vispe.rotary.fused_report() (trusted / fell back and why / not tried per kind)
#   bandwidth.md   the rotation alone on ViT-B q / k: fused, reference, compiled reference, Liger (GB/s)
#   hosts.log      the adapters into other libraries on the GPU, each patched with the host's own encoding
#                  against the unpatched host (goal: within 3 %): a ViT-L-size transformers ViT and DINOv3
#                  (benchmarks/transformers_vision.py, bf16, batch 64) and FLUX-size diffusers blocks (24 x 128
#                  heads, 4,096 image tokens; benchmarks/dit.py, bf16); they need transformers and diffusers
#                  (carry their wheels and those of huggingface-hub, tokenizers, safetensors where missing)
#   cuda_check.md  benchmarks/cuda_check.py: ViT-B/16 224 bf16, eager and compiled, batch 64 (and 256
#                  within the time left), ratios against pe='none', memory, attention backend
# SECONDS (default 540) is the whole run's budget; cuda_check.py gets what the first stages leave.
# GPU_CHECK_DEVICE=cpu smoke-tests this script on a machine without a GPU (tiny shapes, Triton's
# interpreter, the cuda tests skipped).
set -u
OUT_DIR=${1:?usage: gpu_check.sh OUT_DIR [WHEEL_DIR] [SECONDS]}
WHEEL_DIR=${2:-wheels}
TOTAL=${3:-540}
START=$(date +%s)
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then  # tiny shapes: the plumbing, not the figures
    NUMERICS_ARGS=(--quick --cases matrix --dtypes fp32)
    BANDWIDTH_ARGS=(--batch 1 --heads 2 --grid 4 --head-dim 16 --no-compile)
    CHECK_ARGS=(--model vit_tiny --batch 2 --modes eager --rounds 1)
    PES=rope_mixed,liere
    PYTEST_ARGS=(-k 'cuda or auto')
    SELFCHECK_ARGS=(--batch 1 --heads 2 --tokens 17 --head-dim 16 --rounds 1)
    VISION_ARGS=(--width 128 --depth 1 --img 32 --batch 2 --rounds 1 --pes)
    DIT_ARGS=(--hosts flux --layers 2 --heads 2 --head-dim 32 --grid 8 --rounds 1)
else
    NUMERICS_ARGS=()
    BANDWIDTH_ARGS=()
    CHECK_ARGS=(--batch 64,256)
    # the issue's targets first: compiled models are compiled in this order while the budget lasts
    PES=rope_mixed,liere,rope_axial,comrope_ap,string_cayley,irpe,learned,sincos,peg,fourier_learnable
    PES=$PES,comrope_ld,string_circulant,gta,pape_ri,swin_rpb,alibi2d,rope_timm,prope,gta_multiview
    PYTEST_ARGS=(-n 8)
    SELFCHECK_ARGS=()
    VISION_ARGS=(--width 1024 --depth 4 --batch 64 --dtype bfloat16 --pes rope_mixed liere)
    DIT_ARGS=(--hosts flux wan --layers 2 --heads 24 --head-dim 128 --grid 64 --dtype bfloat16 --compile)
fi

say() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$LOG"; }

# --- install only what this machine lacks
SITE=/tmp/vispe_gpu_check_site
missing=()
for whl in "$WHEEL_DIR"/*.whl; do
    [ -e "$whl" ] || continue
    base=$(basename "$whl")
    name=${base%%-*}
    version=$(echo "$base" | cut -d- -f2)
    have=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null || echo none)
    if [ "$have" != "$version" ]; then missing+=("$whl"); say "install $name $version (machine: $have)"; fi
done
if [ ${#missing[@]} -gt 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${missing[@]}" \
        >>"$LOG" 2>&1 || say "pip install failed (see above)"
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# --- what ran where
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    $PY - <<'EOF' 2>&1
import importlib.metadata as m, platform, torch
names = ['torch', 'triton', 'timm', 'transformers', 'diffusers', 'liger-kernel']
def ver(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return '-'
print('python', platform.python_version(), '|', ', '.join(f'{n} {ver(n)}' for n in names))
if torch.cuda.is_available():
    print('cuda', torch.version.cuda, '| device', torch.cuda.get_device_name(), torch.cuda.get_device_capability())
import vispe
print('vispe imports; fused kernels available:', vispe.rotary.fused.AVAILABLE)
EOF
} | tee -a "$LOG"

run_stage() {  # name, seconds, file for its output too ('' for none), command...
    local name=$1 seconds=$2 file=${3:-/dev/null}
    shift 3
    say "== $name (limit $seconds s)"
    timeout "$seconds" "$@" 2>&1 | tee -a "$LOG" "$file"
    local rc=${PIPESTATUS[0]}
    say "== $name: exit $rc"
}

run_stage 'fused kernels on CUDA (pytest)' 150 "$OUT_DIR/pytest.log" \
    $PY -m pytest -p no:cacheprovider -q -rfE -m 'not slow' "${PYTEST_ARGS[@]}" \
    tests/test_cuda_fused.py tests/test_triton_rotary.py
run_stage 'fused self-check and report' 90 '' $PY benchmarks/fused_selfcheck.py --device "$DEVICE" \
    "${SELFCHECK_ARGS[@]}" --out "$OUT_DIR/fused_selfcheck.md"
run_stage 'numerics table' 90 '' $PY benchmarks/fused_numerics.py --device "$DEVICE" "${NUMERICS_ARGS[@]}" \
    --out "$OUT_DIR/numerics.md"
run_stage 'rotation bandwidth' 120 '' $PY benchmarks/rotation_bandwidth.py --device "$DEVICE" "${BANDWIDTH_ARGS[@]}" \
    --out "$OUT_DIR/bandwidth.md"

run_stage 'transformers vision towers: own encoding vs unpatched' 60 "$OUT_DIR/hosts.log" \
    $PY benchmarks/transformers_vision.py --device "$DEVICE" "${VISION_ARGS[@]}"
run_stage 'transformers DINOv3 rope: own encoding vs unpatched' 40 "$OUT_DIR/hosts.log" \
    $PY benchmarks/transformers_vision.py --family dinov3 --device "$DEVICE" "${VISION_ARGS[@]}"
run_stage 'diffusion transformers: own encoding vs unpatched' 90 "$OUT_DIR/hosts.log" \
    $PY benchmarks/dit.py --device "$DEVICE" "${DIT_ARGS[@]}"

left=$(( TOTAL - ($(date +%s) - START) - 15 ))
if [ $left -gt 60 ]; then
    run_stage 'cuda_check' $(( left + 10 )) "$OUT_DIR/cuda_check.log" \
        $PY benchmarks/cuda_check.py --device "$DEVICE" "${CHECK_ARGS[@]}" --pes "$PES" \
        --budget-min "$($PY -c "print(round($left / 60, 2))")" --out "$OUT_DIR/cuda_check.md"
else
    say "cuda_check skipped: $left s left"
fi
say "done"
