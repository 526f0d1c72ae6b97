#!/usr/bin/env bash
# Every GPU check of scripts/ in one run, for a lent GPU machine (the device tool's `run`):
#   bash scripts/run_gpu_validation.sh OUT_DIR [PHASE ...]
# Phases (default: all, in this order): sdpa lag fidelity validate. Needs python3 with a CUDA
# torch; oomkit runs from src/ (its pure core). Each phase has its own time limit so that one
# hang leaves the others' results. Writes OUT_DIR/validation/*.json and OUT_DIR/log.txt; with
# SNAPSHOTS=1 the validation runs' snapshots too, as OUT_DIR/snapshots.tar.xz (split into 15 MiB
# parts when larger).
set -u
out=${1:?usage: run_gpu_validation.sh OUT_DIR [PHASE ...]}
shift
phases=${*:-sdpa lag fidelity validate}
mkdir -p "$out/validation"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "$out/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())"
snapshots=$(mktemp -d)
for phase in $phases; do
    start=$SECONDS
    case $phase in
        sdpa) timeout 120 python3 scripts/probe_sdpa_on_gpu.py --out "$out/validation/sdpa-probe.json" ;;
        lag) timeout 150 python3 scripts/measure_gpu_lag.py --out "$out/validation/gpu-lag.json" ;;
        fidelity) timeout 200 python3 scripts/validate_fidelity_on_gpu.py --out-root "$out" ;;
        validate)
            extra=()
            if [ "${SNAPSHOTS:-0}" = 1 ]; then extra=(--snapshot-dir "$snapshots"); fi
            timeout 300 python3 scripts/validate_on_gpu.py --jobs "${JOBS:-4}" --out-root "$out" "${extra[@]}" ;;
        *) echo "unknown phase $phase"; continue ;;
    esac
    echo "phase $phase: rc $? in $((SECONDS - start)) s"
done
if compgen -G "$snapshots/*.pickle" >/dev/null; then
    (cd "$snapshots" && tar -cJf "$out/snapshots.tar.xz" ./*.pickle)
    if [ "$(stat -c %s "$out/snapshots.tar.xz")" -gt 15728640 ]; then
        split -b 15M "$out/snapshots.tar.xz" "$out/snapshots.tar.xz.part-" && rm "$out/snapshots.tar.xz"
    fi
fi
ls -la "$out" "$out/validation"
