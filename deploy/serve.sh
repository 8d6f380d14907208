#!/usr/bin/env bash
# Entrypoint of one GPU replica: build the archives this GPU lacks, then serve every archive.
#
# An archive is tied to the torch version and GPU architecture it was built on (README.md), so it is
# built here, on the replica's own GPU, the first time: one NAME.mar per task YAML NAME.yaml. The
# model store is a volume: later starts, and other replicas of the same GPU type sharing it, reuse
# what is there. Settings (environment, defaults in brackets):
#   CHECKPOINT [/models/checkpoint]   HF-style directory or .gguf file
#   TASKS_DIR [/models/tasks]         one NAME.yaml per model (archiver/tasks/ has examples)
#   MODEL_STORE [/models/model-store] where NAME.mar is built and served from
#   DEVICE [cuda]                     cpu exercises this script without a GPU
#   ARCHIVER_ARGS []                  extra `python -m archiver build` flags, e.g. "--deadline-ms 50"
#   TS_CONFIG [config.properties beside this script]   PYTHON [python3]
#   BUILD_ONLY [0]                    1: build, then exit 0 instead of serving
#   MPS [1]                           on CUDA, start NVIDIA's MPS daemon before TorchServe (0: don't)
#   DRAIN_QUIET [2], DRAIN_TIMEOUT [25]   on SIGTERM: deploy/drain.py's (below)
#   KSERVE_GATEWAY [0]                1: deploy/kserve_gateway.py serves KServe's endpoints on 0.0.0.0:8080
#                                     and proxies the rest to TorchServe's inference, moved to
#                                     127.0.0.1:8085 (TS_INFERENCE_ADDRESS); deploy/kserve.yaml sets it
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CHECKPOINT=${CHECKPOINT:-/models/checkpoint}
TASKS_DIR=${TASKS_DIR:-/models/tasks}
MODEL_STORE=${MODEL_STORE:-/models/model-store}
DEVICE=${DEVICE:-cuda}
ARCHIVER_ARGS=${ARCHIVER_ARGS:-}
TS_CONFIG=${TS_CONFIG:-$here/config.properties}
PYTHON=${PYTHON:-python3}
BUILD_ONLY=${BUILD_ONLY:-0}
MPS=${MPS:-1}
KSERVE_GATEWAY=${KSERVE_GATEWAY:-0}

refuse() {
  echo "serve.sh: $*" >&2
  exit 2
}

shopt -s nullglob
tasks=("$TASKS_DIR"/*.yaml "$TASKS_DIR"/*.yml)
((${#tasks[@]})) || refuse "no task YAML in TASKS_DIR=$TASKS_DIR (one NAME.yaml per model to serve as NAME)"
[[ -e $CHECKPOINT ]] || refuse "no checkpoint at CHECKPOINT=$CHECKPOINT (an HF-style directory or a .gguf file)"
mkdir -p "$MODEL_STORE"
read -r -a extra_args <<<"$ARCHIVER_ARGS"

# AOTInductor packages segfault at load when a libstdc++ older than the compiler's is loaded first
# (seen on the H200); preloading the compiler's own is harmless where that cannot happen. Both the
# build (it checks the compiled graph) and TorchServe's workers load packages.
if [[ -z ${LD_PRELOAD:-} ]] && command -v g++ >/dev/null; then
  libstdcxx=$(g++ -print-file-name=libstdc++.so.6)
  if [[ $libstdcxx == /* ]]; then export LD_PRELOAD=$libstdcxx; fi
fi

build() { # build() TASK NAME: NAME.mar into the model store, unless it is there
  local task=$1 name=$2 mar=$MODEL_STORE/$2.mar lock tmp
  if [[ -f $mar ]]; then
    echo "serve.sh: $name.mar is in $MODEL_STORE, reusing it (delete it to rebuild)"
    return
  fi
  # One builder per archive among the replicas sharing the store; the others wait, then reuse it.
  exec {lock}>"$MODEL_STORE/.$name.lock"
  flock "$lock"
  if [[ -f $mar ]]; then
    echo "serve.sh: $name.mar was built by another replica, reusing it"
  else
    # Build beside the store (same filesystem: the rename is atomic), under a hidden name that
    # TorchServe skips: a crashed build never leaves a half archive to load. Leftovers of a build
    # killed earlier are removed here, where no one else can be building this name.
    rm -rf "$MODEL_STORE/.build-$name".*
    tmp=$(mktemp -d "$MODEL_STORE/.build-$name.XXXXXX")
    echo "serve.sh: building $name.mar from $task on $DEVICE (minutes: export, compile, check)"
    "$PYTHON" -m archiver build --checkpoint "$CHECKPOINT" --task "$task" --model-name "$name" \
      --export-path "$tmp" --device "$DEVICE" "${extra_args[@]}"
    mv -f "$tmp/$name.mar" "$mar"
    rm -rf "$tmp"
  fi
  exec {lock}>&-
}

for task in "${tasks[@]}"; do
  name=$(basename "$task")
  build "$task" "${name%.*}"
done

if [[ $BUILD_ONLY == 1 ]]; then
  exit 0
fi
# The workers sharing this GPU run their kernels side by side under NVIDIA's Multi-Process Service;
# without it the GPU time-slices between them (docs/operations.md, Serving on a GPU). The daemon must run
# before the first worker starts. Its pipe and log directories default to /tmp/nvidia-mps and
# /var/log/nvidia-mps, which the image's non-root user cannot create: they go under TMPDIR, and
# the workers find the daemon through the same CUDA_MPS_PIPE_DIRECTORY. No daemon on CUDA is an
# error (2), since every worker would then time-slice the GPU: MPS=0 serves without it on purpose.
if [[ $DEVICE == cuda* && $MPS == 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-${TMPDIR:-/tmp}/nvidia-mps}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-${TMPDIR:-/tmp}/nvidia-mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  command -v nvidia-cuda-mps-control >/dev/null ||
    refuse "no nvidia-cuda-mps-control here (the NVIDIA container runtime mounts it with the compute capability): MPS=0 serves without it, the workers time-slicing the GPU"
  if ! nvidia-cuda-mps-control -d; then
    # one may run already for this pipe directory: it answers then
    echo get_server_list | nvidia-cuda-mps-control >/dev/null ||
      refuse "nvidia-cuda-mps-control -d failed (its log: $CUDA_MPS_LOG_DIRECTORY/control.log); MPS=0 serves without it"
  fi
  echo "serve.sh: NVIDIA MPS daemon up, pipes in $CUDA_MPS_PIPE_DIRECTORY"
fi
# TorchServe's metrics as the repository's metrics.yaml declares them (QueueTime as a histogram)
export TS_METRICS_CONFIG=${TS_METRICS_CONFIG:-$here/../metrics.yaml}
# SIGTERM (Kubernetes, docker stop) drains before stopping: deploy/drain.py marks the replica
# unready (ready.py), waits until no request arrives and the queues are empty, then TorchServe
# stops with nothing in flight. TorchServe's own SIGTERM handling resets the requests in flight.
python3 "$here/drain.py" --clear  # a replica that starts is not draining
# KServe's and Triton's clients ask readiness and metadata endpoints that TorchServe does not
# answer: the gateway answers them on the inference port and proxies the rest to TorchServe, whose
# inference moves to loopback (TorchServe takes TS_* variables for settings with enable_envvars_config).
if [[ $KSERVE_GATEWAY == 1 ]]; then
  export TS_INFERENCE_ADDRESS=${TS_INFERENCE_ADDRESS:-http://127.0.0.1:8085}
  export INFERENCE=$TS_INFERENCE_ADDRESS
fi
torchserve --start --foreground --ncs --ts-config "$TS_CONFIG" --model-store "$MODEL_STORE" --models all &
server=$!
gateway=
if [[ $KSERVE_GATEWAY == 1 ]]; then
  python3 "$here/kserve_gateway.py" &
  gateway=$!
fi
stop_gateway() {
  if [[ -n $gateway ]]; then
    kill -TERM "$gateway" 2>/dev/null || true
    wait "$gateway" || true
  fi
}
# shellcheck disable=SC2317 # run by the trap below
stop() {
  trap - TERM INT
  python3 "$here/drain.py" --config "$TS_CONFIG" || true
  torchserve --stop || kill -TERM "$server" 2>/dev/null || true
  wait "$server" || true
  stop_gateway # last: the requests the drain waits for come through it
  exit 0
}
trap stop TERM INT
# With the gateway, either process ending ends the replica: one whose gateway is gone would stay
# ready to ready.py with nothing listening on its port.
status=0 ended=
wait -n -p ended "$server" ${gateway:+"$gateway"} || status=$?
if [[ -n $gateway && $ended == "$gateway" ]]; then
  echo "serve.sh: the KServe gateway exited ($status): stopping TorchServe" >&2
  torchserve --stop || kill -TERM "$server" 2>/dev/null || true
  wait "$server" || true
  exit 1
fi
stop_gateway
exit "$status"
