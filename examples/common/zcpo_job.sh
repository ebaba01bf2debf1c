# The body of the examples' train.sbatch scripts (sourced, not run): one Slurm allocation split into
# training nodes (the first TRAIN_NODES) and rollout nodes (the rest), or, with PLACEMENT=colocated
# (the config's rollout.placement), every node trains and serves: the servers start with
# --enable-memory-saver on all GPUs (sglang_node.py reads it from the resolved config), the training
# step shares the GPUs with them (srun --overlap), and rank 0 has the servers release their memory
# before the models are built (megatron_zcpo/rollout/placement.py).
#
#   1. convert HF_MODEL to a Megatron checkpoint at MEGATRON_CKPT if it is not there (one task; the
#      checkpoint does not depend on the layout);
#   2. plan the SGLang servers (examples/common/sglang_node.py --print) and run every start-up check
#      of the run config with every override (zcpo train --dry-run --nproc <training GPUs>: data,
#      reward function, layout on the job's training GPUs), before anything long starts;
#   3. start the SGLang servers and the router on the rollout nodes (one srun step, one task per
#      node) with the settings the resolved config needs (context length, router timeout,
#      deterministic inference with sampling seeds) and a fresh per-job API key
#      (ZCPO_SGLANG_API_KEY, which the training tasks inherit and send), bound to their nodes'
#      addresses; wait until every server answers /health_generate and the router /readiness;
#   4. run `zcpo train` with srun on the training nodes, one task per GPU: every task reads
#      SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, MASTER_ADDR is the first training node and
#      MASTER_PORT comes from the job id; global rank 0 drives the rollout servers;
#   5. stop the servers when training ends (or fails); when it stopped at a checkpoint after
#      USR1/TERM (exit 75: the time limit is near, or the job is preempted) requeue the job, which
#      resumes from that checkpoint (checkpoint.resume=auto).
#
# The sourcing script sets (each overridable from the environment): CONFIG, HF_MODEL, MEGATRON_CKPT,
# TRAIN_DATA, EVAL_DATA (comma-separated files), RUN_DIR, TRAIN_NODES, ROLLOUT_TP (above the GPUs of a
# node: servers spanning ROLLOUT_TP / GPUs-per-node nodes), PLACEMENT (disaggregated | colocated, default
# disaggregated), CONVERT_ARGS (extra flags of the checkpoint conversion, e.g. "--mtp drop"). The training layout is CONFIG's parallel.* alone (change it there
# or with ZCPO_OVERRIDES=parallel.tensor=N ...); the job trains on TRAIN_NODES x the GPUs per node,
# DP = that / (TP*PP*CP). Runtime, also from the environment:
#   CONTAINER_IMAGE   enroot/pyxis image (e.g. a .sqsh of the repository's Dockerfile); empty: use VENV
#   CONTAINER_MOUNTS  extra pyxis mounts (the file systems holding models, data and RUN_DIR)
#   VENV              virtual environment with this package installed (default: $REPO_DIR/.venv)
#   SGLANG_PYTHON     interpreter with sglang + sglang-router (the image: /opt/sglang/bin/python)
#   SGLANG_NODE_ARGS  extra flags for sglang_node.py, space-separated (e.g. "--quantization modelopt_fp8")
#   SGLANG_CONTAINER_IMAGE  run the rollout nodes in another image (e.g. SGLang's release image
#                     lmsysorg/sglang:v0.5.3-cu129); the checkout is mounted and put on PYTHONPATH
#   ZCPO_OVERRIDES    extra key=value overrides, space-separated (also: arguments of sbatch SCRIPT ...)
#   SGLANG_STARTUP_TIMEOUT  seconds to wait for the servers (default 1800)
#   SGLANG_HEALTH_POLL_S    seconds between two health polls of the servers (default 15)
#   SGLANG_SERVER_URLS, SGLANG_ROUTER_URL  attach to servers that already run (comma-separated
#                     URLs; the router is optional): no rollout nodes are used, every node trains;
#                     their API key (if any) in ZCPO_SGLANG_API_KEY

set -euo pipefail

log() { echo "[$(date '+%F %T')] $*"; }
die() { echo "error: $*" >&2; exit 1; }

# "a,b" -> ["a","b"] (a YAML/JSON list for a key=value override)
json_list() {
    local IFS=, item out=""
    for item in $1; do out+="${out:+,}\"${item}\""; done
    echo "[${out}]"
}

zcpo_job_main() {
    [[ -n "${SLURM_JOB_ID:-}" ]] || die "run this script with sbatch"
    [[ -f "${REPO_DIR}/examples/common/sglang_node.py" ]] || die "REPO_DIR=${REPO_DIR} is not the repository root (submit from it or set REPO_DIR)"
    local stale
    for stale in TRAIN_TP TRAIN_PP TRAIN_CP TRAIN_EP; do  # a second source of the layout could disagree
        [[ -z "${!stale:-}" ]] || die "${stale} is not read: the layout is parallel.* of ${CONFIG}; set it there or with ZCPO_OVERRIDES (e.g. parallel.tensor=8 parallel.pipeline=1)"
    done
    local gpus_per_node="${SLURM_GPUS_ON_NODE:-8}"
    local cpus_per_node="${SLURM_CPUS_ON_NODE:-$(nproc)}"

    # ------------------------------------------------------------------ placement
    local nodes train_hosts rollout_hosts train_list rollout_list
    local attach="${SGLANG_SERVER_URLS:+yes}" colocated=""
    [[ "${PLACEMENT:-disaggregated}" == colocated ]] && colocated=yes
    mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST}")
    if [[ -n "${colocated}" ]]; then
        (( ${#nodes[@]} == TRAIN_NODES )) || die "${#nodes[@]} nodes: PLACEMENT=colocated trains and serves on all TRAIN_NODES=${TRAIN_NODES}"
    elif [[ -n "${attach}" ]]; then
        (( ${#nodes[@]} >= TRAIN_NODES )) || die "${#nodes[@]} nodes: TRAIN_NODES=${TRAIN_NODES} needs more"
    else
        (( ${#nodes[@]} > TRAIN_NODES )) || die "${#nodes[@]} nodes: need more than TRAIN_NODES=${TRAIN_NODES} (the rest serve rollouts)"
    fi
    train_hosts=("${nodes[@]:0:TRAIN_NODES}")
    rollout_hosts=("${nodes[@]:TRAIN_NODES}")
    [[ -z "${colocated}" ]] || rollout_hosts=("${train_hosts[@]}")  # the same GPUs, in turns
    train_list=$(IFS=,; echo "${train_hosts[*]}")
    rollout_list=$(IFS=,; echo "${rollout_hosts[*]}")
    local train_gpus=$(( TRAIN_NODES * gpus_per_node ))
    log "training: ${train_list} (${train_gpus} GPUs, the layout of ${CONFIG})"
    if [[ -n "${attach}" ]]; then
        log "rollout:  attaching to ${SGLANG_SERVER_URLS} (router: ${SGLANG_ROUTER_URL:-none})"
    else
        (( ${#rollout_hosts[@]} * gpus_per_node % ROLLOUT_TP == 0 )) || die "${#rollout_hosts[@]} rollout nodes of ${gpus_per_node} GPUs do not split into servers of ROLLOUT_TP=${ROLLOUT_TP} GPUs"
        log "rollout:  ${rollout_list} ($(( ${#rollout_hosts[@]} * gpus_per_node / ROLLOUT_TP )) SGLang servers at TP${ROLLOUT_TP})"
    fi

    # ------------------------------------------------------------------ runtime
    local workdir runtime
    if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
        # The image installs this package editable at /opt/megatron_zcpo: mounting the checkout
        # there runs the checkout's code and configs with the image's libraries.
        workdir=/opt/megatron_zcpo
        runtime=(--container-image="${CONTAINER_IMAGE}" --container-name="zcpo-${SLURM_JOB_ID}"
                 --container-workdir="${workdir}"
                 --container-mounts="${REPO_DIR}:${workdir}${CONTAINER_MOUNTS:+,${CONTAINER_MOUNTS}}")
        SGLANG_PYTHON="${SGLANG_PYTHON:-/opt/sglang/bin/python}"
    else
        workdir="${REPO_DIR}"
        set +u  # some activate scripts read unset variables
        # shellcheck disable=SC1091
        source "${VENV:-${REPO_DIR}/.venv}/bin/activate"
        set -u
        runtime=(--chdir="${workdir}")
        SGLANG_PYTHON="${SGLANG_PYTHON:-python}"
    fi
    local sglang_runtime=("${runtime[@]}") node_python=python  # node_python runs sglang_node.py itself
    if [[ -n "${SGLANG_CONTAINER_IMAGE:-}" ]]; then
        # Only torch and this checkout are needed next to SGLang to run sglang_node.py.
        sglang_runtime=(--container-image="${SGLANG_CONTAINER_IMAGE}" --container-name="zcpo-sglang-${SLURM_JOB_ID}"
                        --container-workdir=/opt/megatron_zcpo --export="ALL,PYTHONPATH=/opt/megatron_zcpo"
                        --container-mounts="${REPO_DIR}:/opt/megatron_zcpo${CONTAINER_MOUNTS:+,${CONTAINER_MOUNTS}}")
        SGLANG_PYTHON=python3 node_python=python3
    fi
    mkdir -p "${RUN_DIR}"

    # ------------------------------------------------------------------ 1. checkpoint conversion
    if [[ ! -f "${MEGATRON_CKPT}/model_config.json" ]]; then
        log "converting ${HF_MODEL} -> ${MEGATRON_CKPT}"
        rm -rf "${MEGATRON_CKPT}.partial"
        local convert_args=()
        read -r -a convert_args <<< "${CONVERT_ARGS:-}"
        srun "${runtime[@]}" --nodes=1 --ntasks=1 --nodelist="${train_hosts[0]}" --gpus-per-node="${gpus_per_node}" \
            --cpus-per-task="${cpus_per_node}" \
            python tools/convert_hf_to_megatron.py --hf-dir "${HF_MODEL}" --out "${MEGATRON_CKPT}.partial" "${convert_args[@]}"
        mv "${MEGATRON_CKPT}.partial" "${MEGATRON_CKPT}"  # a complete checkpoint or none
    fi

    # ------------------------------------------------------------------ 2. addresses and config check
    local sglang_args=(--model-path "${HF_MODEL}" --nodes "${rollout_list}" --tp-size "${ROLLOUT_TP}"
                       --gpus-per-node "${gpus_per_node}" --python "${SGLANG_PYTHON}"
                       --log-dir "${RUN_DIR}/sglang_logs")
    local node_args=()
    read -r -a node_args <<< "${SGLANG_NODE_ARGS:-}"
    sglang_args+=("${node_args[@]}")
    local addresses server_urls router_url
    if [[ -n "${attach}" ]]; then
        server_urls=$(json_list "${SGLANG_SERVER_URLS}")
        router_url="${SGLANG_ROUTER_URL:-null}"
    else
        addresses=$(srun "${runtime[@]}" --nodes=1 --ntasks=1 --nodelist="${rollout_hosts[0]}" \
            python examples/common/sglang_node.py "${sglang_args[@]}" --print)
        { read -r server_urls; read -r router_url; } <<< "${addresses}"
        [[ "${server_urls}" == '["http'* && "${router_url}" == http* ]] || die "unexpected server plan: ${addresses}"
    fi
    log "servers: ${server_urls}; router: ${router_url}"

    local overrides=(
        "model.path=${MEGATRON_CKPT}"
        "data.train_files=$(json_list "${TRAIN_DATA}")"
        "eval.data.train_files=$(json_list "${EVAL_DATA}")"
        "rollout.sglang.server_urls=${server_urls}"
        "rollout.sglang.router_url=${router_url}"
        "logging.run_dir=${RUN_DIR}"
        "rollout.placement=${PLACEMENT:-disaggregated}"
    )
    local extra=()
    read -r -a extra <<< "${ZCPO_OVERRIDES:-}"
    overrides+=("${extra[@]}" "$@")
    # On a training node (its GPU's memory, the files as the training tasks see them). This one-task
    # step has SLURM_NTASKS=1: --nproc names the training step's world, which the layout must fit.
    srun "${runtime[@]}" --nodes=1 --ntasks=1 --nodelist="${train_hosts[0]}" --gpus-per-node="${gpus_per_node}" \
        zcpo train "${CONFIG}" "${overrides[@]}" --dry-run --nproc "${train_gpus}" > "${RUN_DIR}/config.resolved.yaml"
    log "config valid: ${RUN_DIR}/config.resolved.yaml"

    # ------------------------------------------------------------------ 3. SGLang servers + router
    if [[ -z "${attach}" ]]; then
        # A fresh key per job: servers and router refuse requests without it (401); the training
        # tasks inherit it from this environment and send it (rollout.sglang.client.api_key).
        ZCPO_SGLANG_API_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
        export ZCPO_SGLANG_API_KEY
        srun "${sglang_runtime[@]}" ${colocated:+--overlap} --nodes="${#rollout_hosts[@]}" --ntasks-per-node=1 --nodelist="${rollout_list}" \
            --gpus-per-node="${gpus_per_node}" --cpus-per-task="${cpus_per_node}" \
            "${node_python}" examples/common/sglang_node.py "${sglang_args[@]}" \
            --run-config "${RUN_DIR}/config.resolved.yaml" > "${RUN_DIR}/sglang_step.log" 2>&1 &
        SGLANG_STEP_PID=$!
        trap stop_sglang EXIT
    fi
    wait_for_health "${server_urls}" "${router_url/#null/}"

    # ------------------------------------------------------------------ 4. training
    export MASTER_ADDR="${train_hosts[0]}"
    export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))
    export CUDA_DEVICE_MAX_CONNECTIONS=1          # megatron-core: TP/SP communication ordering
    if [[ -n "${colocated}" ]]; then
        unset PYTORCH_CUDA_ALLOC_CONF  # expandable segments break the CUDA IPC handles of the weight push
    else
        export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # sequence lengths vary step to step
    fi
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
    log "training: zcpo train ${CONFIG} (MASTER_ADDR=${MASTER_ADDR} MASTER_PORT=${MASTER_PORT})"
    srun "${runtime[@]}" ${colocated:+--overlap} --nodes="${TRAIN_NODES}" --ntasks-per-node="${gpus_per_node}" --nodelist="${train_list}" \
        --gpus-per-node="${gpus_per_node}" --cpus-per-task=$(( cpus_per_node / gpus_per_node )) \
        --kill-on-bad-exit=1 \
        zcpo train "${CONFIG}" "${overrides[@]}" &
    wait_for_training $!
    local rc=${TRAINING_EXIT_CODE}
    if (( rc == PREEMPTED_EXIT_CODE )); then
        log "training stopped at a checkpoint (exit ${rc}): requeueing job ${SLURM_JOB_ID} to resume"
        scontrol requeue "${SLURM_JOB_ID}"
        return 0
    fi
    (( rc == 0 )) || die "training failed (exit ${rc})"
    log "training finished"
}

# `zcpo train` exits with this after SIGUSR1/SIGTERM once its checkpoint is written
# (megatron_zcpo/training/preemption.py).
PREEMPTED_EXIT_CODE=75

# Wait for the training srun (pid $1); its exit code ends up in TRAINING_EXIT_CODE. Slurm's time-limit warning
# (--signal=B:USR1@300) and a preemption's TERM reach this batch shell: they are passed to srun,
# which forwards them to every training task; the tasks stop after their current step.
wait_for_training() {
    local pid=$1 rc=0
    trap 'log "USR1: training stops after its current step"; kill -USR1 '"${pid}"' 2>/dev/null || true' USR1
    trap 'log "TERM: training stops after its current step"; kill -TERM '"${pid}"' 2>/dev/null || true' TERM
    while :; do
        rc=0
        wait "${pid}" || rc=$?
        # A trapped signal interrupts `wait` (status > 128) while srun still runs: wait again.
        if (( rc > 128 )) && kill -0 "${pid}" 2>/dev/null; then continue; fi
        break
    done
    trap - USR1 TERM
    TRAINING_EXIT_CODE=${rc}
}

# Poll every server's /health_generate and the router's /readiness until all answer 200 (what the
# client checks too): sglang-router 0.2.0 answers its own /health_generate with 503, always.
wait_for_health() {
    local urls deadline=$(( SECONDS + ${SGLANG_STARTUP_TIMEOUT:-1800} )) url waiting
    read -r -a urls <<< "$(echo "$1" | tr -d '[]"' | tr ',' ' ' | sed 's,[^ ][^ ]*,&/health_generate,g') ${2:+$2/readiness}"
    while :; do
        waiting=()
        for url in "${urls[@]}"; do
            curl -sf -o /dev/null --max-time 30 "${url}" || waiting+=("${url}")
        done
        (( ${#waiting[@]} == 0 )) && { log "SGLang: ${#urls[@]} endpoints healthy"; return 0; }
        [[ -z "${SGLANG_STEP_PID:-}" ]] || kill -0 "${SGLANG_STEP_PID}" 2>/dev/null || die "the SGLang step exited; see ${RUN_DIR}/sglang_step.log and ${RUN_DIR}/sglang_logs/"
        (( SECONDS < deadline )) || die "not healthy after ${SGLANG_STARTUP_TIMEOUT:-1800}s: ${waiting[*]}"
        sleep "${SGLANG_HEALTH_POLL_S:-15}"
    done
}

stop_sglang() {
    if [[ -n "${SGLANG_STEP_PID:-}" ]] && kill -0 "${SGLANG_STEP_PID}" 2>/dev/null; then
        log "stopping the SGLang servers"
        kill -TERM "${SGLANG_STEP_PID}" 2>/dev/null || true  # srun forwards SIGTERM to its tasks
        wait "${SGLANG_STEP_PID}" 2>/dev/null || true
    fi
}
