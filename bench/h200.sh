#!/usr/bin/env bash
# The H200 steps of bench/README.md, one per device call (each call may run 10 minutes; archives
# built into .bench-work/ survive between calls while the machine stays warm).
#   bash bench/h200.sh build   # archives for W1/W2/W3 ($VARIANTS below, hf, noop), 6 at a time
#   bash bench/h200.sh check   # the fast GPU tests: kernels at full size, CUDA engine vs transformers, export
#   bash bench/h200.sh check-full  # every GPU test (adds AOTInductor builds and a CUDA TorchServe worker)
#   bash bench/h200.sh kernels # the kernel bench (attention, QK-norm + RoPE, vocabulary top-k)
#   bash bench/h200.sh gemm    # the linears of W1 and of the beam decode: cuBLAS bf16, Inductor max-autotune, FP8
#   bash bench/h200.sh stepbench # a beam decode layer-step and step in process, each variant against its floor
#   bash bench/h200.sh bench   # the measured run: noop ceiling, every $SLM deployment and the HF
#                              # peer on W1-W3, served-answer check, report, PNGs
#   bash bench/h200.sh profile # where one request's time goes, per archive, CUDA graphs on/off
#   bash bench/h200.sh loadtime # where a worker's package load goes (bench.load_time), per default archive
#   bash bench/h200.sh cpupath # the handler's CPU path (bench.cpu_path) per tokenizer thread pool size
#   bash bench/h200.sh catalogswap # W4 following a catalog store: catalogs swapped in place under 0.8x capacity
#   bash bench/h200.sh reliability # on the archiver's default deployments: bad input (bench.reliability fuzz),
#                              # 3x capacity for 60 s (overload); $SOAK seconds at 0.8x capacity if set
#   bash bench/h200.sh start   # in the background: build beside check + kernels, then profile, then bench,
#                              # into .bench-work/out; then follow
#   bash bench/h200.sh follow  # wait (up to $FOLLOW s, default 560) for it; what is done comes back
#                              # as $OUT/pipeline.tgz
# The pipeline (`start`) outlives the call: a process in its own session runs on while the machine
# stays warm, so each next call is just `follow`, back to back (the machine goes back when idle).
# Needs: carry [".devbundle", "bench/assets"]; $OUT (the device tool's output folder); $COMMIT.
# Optional: $VARIANTS, $SLM (below), $SYSTEMS (slm,hf: SYSTEMS=slm leaves the peer out), PROFILE=0, CHECK=0, KERNELS=0,
# KERNELS_ONLY=TEXT (the kernel bench's cases whose name holds TEXT), STEP_BENCH=1 (bench.step_bench
# first in the check slot, beside the build; STEP_BENCH_ARGS, e.g. --rows 100,800; STEP_BENCH_VARIANTS,
# e.g. "bf16,fp8-static"),
# CHECK_ONLY=EXPR (the check step's pytest -k), BENCH=0, CATALOG_SWAP=1 (the catalogswap step, last; SWAPS, CAPACITY), LOADTIME=1 (the loadtime step after the profiles;
# LOADTIME_ONLY=TEXT: bench.load_time's steps whose name holds TEXT, e.g. load_graph), CPU_PATH=1 (first, the host quiet: bench.cpu_path
# per tokenizer thread pool size, $CPU_PATH_THREADS, default "1 2 4 16"),
# RELIABILITY=1 (the reliability step after the bench; SOAK=600 adds the soak; DEADLINE=80: every
# overload request carries that deadline; STEPS=fuzz,overload,kill,gpu-fault adds kill -9 of a worker
# and a GPU fault beside the workers, each under load for $FAULT_SECONDS (60); STEPS=ready,scale-up: the
# workers' start, 1 then 6 together, and doubled under 0.8x capacity; STEPS=none SOAK=600: the soak
# alone; RELIABLE and STEPS: below),
# PROFILE_GRAPHS="on" (default "on off": the profile step with CUDA graphs and without), PROFILE_BEAM
# (default W2,W3: the beam archives' profiled workloads), $WORKLOADS (default W3,W2,W1), $BENCH_ARGS (more bench.run options for the pipeline's bench step,
# e.g. --levels). On nvidia-h200-x2, SLM=...,4:8:g2 spreads 4 workers over 2 GPUs.
# BASE=DIR: a checkout of the baseline commit (e.g. `git archive SHA ':!bench/results' | tar -x -C .base`,
# carried): its slm $VARIANTS are built beside (into .bench-work/base) and profiled beside this
# tree's, as profile_*_base_*.txt: a lever's kernels and GPU time before and after, in one run.
# Needs orjson, tiktoken and regex for Python 3.12 among the bundle's wheels (bench/README.md).
# MPS=1 (default): the pipeline runs NVIDIA's Multi-Process Service, so the workers' processes share
# the GPU instead of time-slicing it (bench/mps.py); MPS=0 leaves it off. NOMPS_SLM=...: after the
# bench step, these deployments again without MPS (the same run's comparison), into $OUT/nomps.
set -u
source .devbundle/setup.sh
WORK=.bench-work
COMMIT=${COMMIT:-unknown}
# every slm archive the steps below use: workers:batch[:options] (the workers do not need a build)
VARIANTS=${VARIANTS:-1:4:score,1:4:fp8static:score,1:8:beam}
# the deployments measured: the archiver's defaults, two workers per GPU (score: max_batch 4; beam:
# 8), and W1's fastest, three workers in fp8-static (bench/RESULTS.md)
SLM=${SLM:-2:4:score,2:4:fp8static:score,3:4:fp8static:score,2:8:beam}
WORKLOADS=${WORKLOADS:-W3,W2,W1}
PIPE=$WORK/out
ARGS=(--device cuda --tokenizer bench/assets/tokenizer.json --work "$WORK" --commit "$COMMIT")

mps() {  # NVIDIA MPS on (1) or off (0) for the CUDA processes started from now on. pgrep -x matches the
    # process name, 15 characters: nvidia-cuda-mps is the control daemon and its server alike
    if [ "$1" = 1 ]; then
        pgrep -x nvidia-cuda-mps > /dev/null || nvidia-cuda-mps-control -d
    elif pgrep -x nvidia-cuda-mps > /dev/null; then
        echo quit | nvidia-cuda-mps-control
        for _ in $(seq 60); do pgrep -x nvidia-cuda-mps > /dev/null || break; sleep 0.5; done
    fi
    echo "NVIDIA MPS: $(pgrep -x nvidia-cuda-mps > /dev/null && echo on || echo off)"
}

# setup.sh installs the bundle's wheels only while TorchServe is missing: wheels added to the bundle
# later (orjson, tiktoken, regex) are installed here
python3 -c "import orjson, tiktoken" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site .devbundle/orjson-*.whl .devbundle/tiktoken-*.whl .devbundle/regex-*.whl 2>/dev/null
python3 -c "import orjson, tiktoken" || { echo "orjson or tiktoken is missing: put their wheels into .devbundle (bench/README.md)"; exit 1; }

case "$1" in
build)
    [ -z "${BASE:-}" ] || (cd "$BASE" && python3 -m bench.run --device cuda --tokenizer "$OLDPWD/bench/assets/tokenizer.json" \
        --work "$OLDPWD/$WORK/base" --commit base --jobs 3 --build-only --systems slm --slm "$VARIANTS" \
        --workloads "$WORKLOADS" > "$OLDPWD/$WORK/build-base.log" 2>&1) &
    python3 -m bench.run "${ARGS[@]}" --jobs 6 --build-only --slm "$VARIANTS" --workloads "$WORKLOADS"
    wait ;;
check)
    python3 -m pytest -q -s tests/gpu -p no:cacheprovider -k "${CHECK_ONLY:-bf16 or export or triton_attention or two_gpus}" ;;
check-full)
    python3 -m pytest -q -s tests/gpu -p no:cacheprovider ;;
kernels)
    python3 -m bench.kernels_bench --out "$OUT/kernels_bench.json" ${KERNELS_ONLY:+--only "$KERNELS_ONLY"} ;;
gemm)
    python3 -m bench.gemm_bench --out "$OUT/gemm_bench.json" ;;
stepbench)
    python3 -m bench.step_bench --out "$OUT/step_bench.json" ${STEP_BENCH_ARGS:-} \
        ${STEP_BENCH_VARIANTS:+--variants "$STEP_BENCH_VARIANTS"} ;;
bench)
    python3 -m bench.run "${ARGS[@]}" --out "$OUT" --warmup 1.5 --duration 3 --slm "$SLM" --no-build \
        --workloads "$WORKLOADS" --hf-workers 4 --systems "${SYSTEMS:-slm,hf}" "${@:2}"
    python3 -m bench.report "$OUT"/*_bench.jsonl --png-dir "$OUT" ;;
profile)
    # one request per call, with and without CUDA graphs, per built Triton archive
    for mar in "$WORK"/model-store/slm_*_b?.mar "$WORK"/model-store/slm_*_b?_fp8static.mar "$WORK"/base/model-store/slm_*_b?.mar; do
        [ -e "$mar" ] || continue
        name=$(basename "$mar" .mar)
        case "$mar" in "$WORK"/base/*) name=base_$name ;; esac
        [ -d "$WORK/unpacked/$name" ] || python3 -m zipfile -e "$mar" "$WORK/unpacked/$name"
        case "$name" in *score*) ws=W1 ;; *) ws=${PROFILE_BEAM:-W2,W3} ;; esac
        for graphs in ${PROFILE_GRAPHS:-on off}; do  # one package load (tens of seconds) for its workloads
            python3 -m bench.profile --package "$WORK/unpacked/$name" --workload "$ws" --batch 1 \
                --cuda-graphs $graphs --tokenizer bench/assets/tokenizer.json \
                --out "$OUT/profile_{workload}_${name}_graphs_${graphs}.txt"
        done
    done ;;
cpupath)
    # the handler's CPU path on this host, per size of the tokenizer's thread pool (a thread pool's
    # start-up may cost small batches more than it saves)
    for threads in ${CPU_PATH_THREADS:-1 2 4 16}; do
        RAYON_NUM_THREADS=$threads python3 -m bench.cpu_path --tokenizer bench/assets/tokenizer.json \
            --workloads W1,W2,W3 --batches 1,2,4
    done ;;
loadtime)
    for mar in "$WORK"/model-store/slm_*_b?.mar; do
        name=$(basename "$mar" .mar)
        [ -d "$WORK/unpacked/$name" ] || python3 -m zipfile -e "$mar" "$WORK/unpacked/$name"
        python3 -m bench.load_time --package "$WORK/unpacked/$name" --out "$OUT/loadtime_${name}.json" \
            --profile "$OUT/loadtime_profile_${name}.txt" ${LOADTIME_ONLY:+--only "$LOADTIME_ONLY"}
    done ;;
catalog)
    # a catalog swapped into the W4 archive: a second 1M-item catalog, as a new archive version
    python3 -c "from pathlib import Path; from bench.workloads import catalog_items; catalog_items(Path('$WORK/catalog-1000000-1.jsonl'), seed=1)"
    for mar in "$WORK"/model-store/slm_retrieve_qwen25_b?.mar; do
        [ -e "$mar" ] || continue
        start=$(date +%s%N)
        python3 -m archiver catalog --archive "$mar" --catalog "$WORK/catalog-1000000-1.jsonl" --version 2.0 --export-path "$WORK/swap"
        echo "catalog swap of $(basename "$mar"): $(( ($(date +%s%N) - start) / 1000000 )) ms"
    done ;;
reliability)
    # the bench step's deployments (NAME_xWORKERS.mar, configured by the archiver for that many
    # workers): by default the archiver's defaults, 2 workers (beam, score); overload with the
    # workload's own requests. RELIABLE: NAME:WORKLOAD[:CAPACITY] (a capacity given skips measuring
    # it); STEPS: bench.reliability's steps. Each copy is made (again) here from its archive, NAME_xN.mar
    # from NAME.mar, as the bench step makes them
    for spec in ${RELIABLE:-slm_beam_qwen25_b8_x2:W2 slm_score_qwen3_b4_x2:W1}; do
        IFS=: read -r name workload capacity <<< "$spec"
        workers=${name##*_x}
        mar="$WORK/model-store/$name.mar"
        base=${name%_x*}
        [ ! -e "$WORK/model-store/$base.mar" ] || python3 -m archiver configure --archive "$WORK/model-store/$base.mar" \
            --export-path "$WORK/model-store" --model-name "$name" --workers "$workers" --response-timeout 600 --device-ids 0
        [ -e "$mar" ] || { echo "no $mar"; continue; }
        case "$name" in *score*) task=(--task score --max-items 16 --max-tokens 160) ;;
                        *) task=(--task beam --max-tokens 512) ;; esac
        common=(--archive "$mar" --workers "$workers" "${task[@]}" --workload "$workload" --tokenizer bench/assets/tokenizer.json)
        [ "${STEPS:-}" = none ] || python3 -m bench.reliability "${STEPS:-fuzz,overload}" "${common[@]}" ${capacity:+--capacity "$capacity"} --seconds 60 \
            ${DEADLINE:+--deadline-ms "$DEADLINE"} ${FAULT_SECONDS:+--fault-seconds "$FAULT_SECONDS"} \
            --out "$OUT/reliability_${name}.json" --logs "$OUT/reliability_logs_${name}" > "$OUT/reliability_${name}.log" 2>&1
        [ -n "${SOAK:-}" ] && python3 -m bench.reliability soak "${common[@]}" ${capacity:+--capacity "$capacity"} --seconds "$SOAK" \
            --out "$OUT/reliability_soak_${name}.json" > "$OUT/reliability_soak_${name}.log" 2>&1
    done ;;
catalogswap)
    # W4's archive following a catalog store, as the archiver's default deployment (2 workers): 1M-item
    # catalogs of seeds 1..$SWAPS (default 3) published in turn under 0.8x $CAPACITY (default 413 req/s,
    # W4's), then a rollback (bench.reliability catalog-swap). Needs the W4 build (VARIANTS=1:8:beam WORKLOADS=W4)
    store=$WORK/catalog-store
    rm -rf "$store"
    python3 -m archiver configure --archive "$WORK/model-store/slm_retrieve_qwen25_b8.mar" --export-path "$WORK/model-store" \
        --model-name retrieve_swap --workers 2 --response-timeout 600 --device-ids 0 --catalog-store "$store" || exit 1
    catalogs=$(python3 -c "from pathlib import Path; from bench.workloads import catalog_items
print(','.join(str(catalog_items(Path('$WORK') / f'catalog-1000000-{s}.jsonl', seed=s)) for s in range(1, ${SWAPS:-3} + 1)))")
    python3 -m bench.reliability catalog-swap --archive "$WORK/model-store/retrieve_swap.mar" --workers 2 --task beam \
        --max-tokens 512 --workload W4 --tokenizer bench/assets/tokenizer.json --capacity "${CAPACITY:-413}" \
        --store "$store" --catalogs "$catalogs" --out "$OUT/catalog_swap.json" --logs "$OUT/catalog_swap_logs" ;;
all)
    export OUT=$PIPE
    mkdir -p "$OUT"
    [ "${CPU_PATH:-0}" = 1 ] && bash "$0" cpupath > "$OUT/cpu_path_threads.txt" 2>&1  # first: the host quiet
    mps "${MPS:-1}"
    bash "$0" build > "$OUT/build.log" 2>&1 &
    # the timings first, before the builds reach their GPU checks
    { [ "${KERNELS:-1}" = 0 ] || bash "$0" kernels > "$OUT/kernels.log" 2>&1
      [ "${STEP_BENCH:-0}" = 0 ] || bash "$0" stepbench > "$OUT/step_bench.log" 2>&1
      [ "${CHECK:-1}" = 0 ] || bash "$0" check > "$OUT/check.log" 2>&1; } &
    wait
    [ "${CATALOG:-0}" = 1 ] && bash "$0" catalog > "$OUT/catalog.log" 2>&1
    # the in-process profiles before the sweeps: the GPU to themselves, and back first
    [ "${PROFILE:-1}" = 1 ] && bash "$0" profile > "$OUT/profile.log" 2>&1
    [ "${LOADTIME:-0}" = 1 ] && bash "$0" loadtime > "$OUT/loadtime.log" 2>&1
    [ "${BENCH:-1}" = 1 ] && bash "$0" bench ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
    if [ -n "${NOMPS_SLM:-}" ]; then
        mps 0
        mkdir -p "$OUT/nomps"
        OUT=$OUT/nomps SLM=$NOMPS_SLM SYSTEMS=slm bash "$0" bench ${BENCH_ARGS:-} > "$OUT/bench_nomps.log" 2>&1
        mps "${MPS:-1}"
    fi
    [ "${RELIABILITY:-0}" = 1 ] && bash "$0" reliability > "$OUT/reliability.log" 2>&1
    [ "${CATALOG_SWAP:-0}" = 1 ] && bash "$0" catalogswap > "$OUT/catalog_swap.log" 2>&1
    touch "$OUT/DONE" ;;
start)
    # a warm machine keeps the last pipeline's out/: its DONE would end `follow` at once
    mkdir -p "$PIPE" && rm -f "$PIPE/DONE" && cp "$0" "$WORK/pipeline.sh"  # runs from a copy: the next call re-sends the tree
    COMMIT=$COMMIT SLM=$SLM VARIANTS=$VARIANTS WORKLOADS=$WORKLOADS SYSTEMS=${SYSTEMS:-slm,hf} \
        BENCH_ARGS=${BENCH_ARGS:-} PROFILE=${PROFILE:-1} CHECK=${CHECK:-1} KERNELS=${KERNELS:-1} \
        RELIABILITY=${RELIABILITY:-0} BENCH=${BENCH:-1} SOAK=${SOAK:-} RELIABLE=${RELIABLE:-} STEPS=${STEPS:-} \
        FAULT_SECONDS=${FAULT_SECONDS:-} DEADLINE=${DEADLINE:-} \
        MPS=${MPS:-1} NOMPS_SLM=${NOMPS_SLM:-} CATALOG=${CATALOG:-0} CATALOG_SWAP=${CATALOG_SWAP:-0} SWAPS=${SWAPS:-3} CAPACITY=${CAPACITY:-413} LOADTIME=${LOADTIME:-0} LOADTIME_ONLY="${LOADTIME_ONLY:-}" PROFILE_GRAPHS="${PROFILE_GRAPHS:-on off}" \
        PROFILE_BEAM=${PROFILE_BEAM:-W2,W3} KERNELS_ONLY="${KERNELS_ONLY:-}" CPU_PATH=${CPU_PATH:-0} CPU_PATH_THREADS="${CPU_PATH_THREADS:-1 2 4 16}" \
        STEP_BENCH=${STEP_BENCH:-0} STEP_BENCH_ARGS="${STEP_BENCH_ARGS:-}" STEP_BENCH_VARIANTS="${STEP_BENCH_VARIANTS:-}" CHECK_ONLY="${CHECK_ONLY:-}" \
        setsid nohup bash "$WORK/pipeline.sh" all > "$WORK/pipeline.log" 2>&1 < /dev/null &
    sleep 5
    bash "$0" follow ;;
follow)
    end=$((SECONDS + ${FOLLOW:-560}))
    while [ ! -e "$PIPE/DONE" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    # one file back (the device tool returns a handful of files per call)
    tar czf "$OUT/pipeline.tgz" -C "$WORK" out pipeline.log $(cd "$WORK" && ls build-*.log 2>/dev/null)
    for f in "$PIPE"/*.log; do echo "== $f"; tail -n 8 "$f"; done
    [ -e "$PIPE/DONE" ] && echo PIPELINE DONE || echo "PIPELINE RUNNING (follow again)" ;;
*)
    echo "usage: bench/h200.sh build|check|check-full|kernels|gemm|bench|profile|loadtime|cpupath|reliability|catalog|catalogswap|start|follow" >&2; exit 2 ;;
esac
