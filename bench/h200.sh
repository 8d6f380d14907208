#!/usr/bin/env bash
# The H200 steps of bench/README.md, one per device call (each call may run 10 minutes; archives
# built into .bench-work/ survive between calls while the machine stays warm).
#   bash bench/h200.sh build   # archives for W1/W2/W3 ($VARIANTS below, hf, noop), 6 at a time
#   bash bench/h200.sh check   # the fast GPU tests: kernels at full size, CUDA engine vs transformers, export
#   bash bench/h200.sh check-full  # every GPU test (adds AOTInductor builds and a CUDA TorchServe worker)
#   bash bench/h200.sh kernels # the attention kernel bench
#   bash bench/h200.sh bench   # the measured run: noop ceiling, sweeps, report, PNGs
#   bash bench/h200.sh levers  # issue 6: slm workers and cross-request batching, W1-W3
#   bash bench/h200.sh profile # where one request's time goes, per built slm archive
# Needs: carry [".devbundle", "bench/assets"]; $OUT (the device tool's output folder); $COMMIT.
set -u
source .devbundle/setup.sh
WORK=.bench-work
COMMIT=${COMMIT:-unknown}
# every slm archive the steps below use: attention:workers:batch (the workers do not need a build)
VARIANTS=reference:1:1,triton:1:1,triton:1:8
ARGS=(--device cuda --tokenizer bench/assets/tokenizer.json --work "$WORK" --commit "$COMMIT")

case "$1" in
build)
    python3 -m bench.run "${ARGS[@]}" --jobs 6 --build-only --slm "$VARIANTS" ;;
check)
    python3 -m pytest -q -s tests/test_gpu.py -p no:cacheprovider -k "bf16 or export" ;;
check-full)
    python3 -m pytest -q -s tests/test_gpu.py -p no:cacheprovider ;;
kernels)
    python3 -m bench.kernels_bench --out "$OUT/kernels_bench.json" ;;
bench)
    python3 -m bench.run "${ARGS[@]}" --out "$OUT" --warmup 2 --duration 4 "${@:2}"
    python3 -m bench.report "$OUT"/*_bench.jsonl --png-dir "$OUT" ;;
levers)
    python3 -m bench.run "${ARGS[@]}" --out "$OUT" --warmup 1 --duration 3 --systems slm \
        --slm triton:1:1,triton:2:1,triton:1:8,triton:2:8 "${@:2}"
    python3 -m bench.report "$OUT"/*_bench.jsonl --png-dir "$OUT" ;;
profile)
    for mar in "$WORK"/model-store/slm_*.mar; do
        name=$(basename "$mar" .mar)
        [ -d "$WORK/unpacked/$name" ] || python3 -m zipfile -e "$mar" "$WORK/unpacked/$name"
        case "$name" in *score*) ws=W1 ;; *) ws="W2 W3" ;; esac
        batch=${name##*_b}
        for w in $ws; do
            python3 -m bench.profile --package "$WORK/unpacked/$name" --workload "$w" --batch "$batch" \
                --tokenizer bench/assets/tokenizer.json --out "$OUT/profile_${w}_${name}.txt"
        done
    done ;;
*)
    echo "usage: bench/h200.sh build|check|check-full|kernels|bench|levers|profile" >&2; exit 2 ;;
esac
