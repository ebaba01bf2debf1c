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
#   5. stop the servers when training ends (or fails); when it stopped at a checkpoint after a stop
#      signal (exit 75) requeue the job, which resumes from that checkpoint (checkpoint.resume=auto).
#
# Stop signals (the time limit's --signal=B:USR1@300 to this script, a preemption's SIGTERM to every
# step's tasks (GraceTime), USR1/TERM from scancel) are handled from the script's first line, in every
# phase: before training the running start-up step is ended (the conversion writes a directory of its
# own, renamed only once complete), the servers are stopped and the job requeues itself; during
# training they are passed on to the training step as USR1 (srun would answer a TERM by killing its
# tasks), whose ranks stop at their next safe point (within seconds during a step's rollout, which is
# abandoned; after the step during its update) with a checkpoint and exit 75; then the servers
# stop and the job requeues itself. The SGLang step survives Slurm's stop signals (the training's last
# step needs it) and stops on SIGINT, which its srun (--disable-status) forwards. Every step names its
# task count (a job submitted with --ntasks-per-node=8 would pass that on); the output file is opened
# in append mode (#SBATCH --open-mode=append), so a requeued job's log continues the first attempt's.
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

# ---------------------------------------------------------------------------- stop signals
# `zcpo train` exits with this after SIGUSR1/SIGTERM once its checkpoint is written
# (megatron_zcpo/training/preemption.py).
PREEMPTED_EXIT_CODE=75
# srun's exit code when its tasks died of SIGTERM: Slurm stopping the job (a preemption's TERM to the steps)
TERMINATED_EXIT_CODE=143
STEP_PID=""        # the start-up step running now (ended on a stop signal: it starts over after the requeue)
SGLANG_STEP_PID="" # the SGLang step (stopped with SIGINT)
TRAINING=""        # set while the training step runs

# A stop signal to this script (USR1: the time limit is near; TERM): recorded (the train.sbatch's first
# line recorded one that came before this file was read) and acted on in the current phase. During
# training it is written to $ZCPO_STOP_FILE, which every rank reads at its safe points (after each
# step); no signal goes to the training step: srun answers a TERM by killing its tasks, and a task
# still starting (or srun itself, in its first moments) dies of one.
on_stop_signal() {
    [[ -n "${ZCPO_STOP_SIGNAL:-}" ]] || ZCPO_STOP_SIGNAL=$1
    if [[ -n "${TRAINING}" ]]; then
        log "$1: training stops at its next safe point (a step's rollout is abandoned, an update stops before its next mini-batch) with a checkpoint, then the job requeues itself"
        { echo "$(kill -l "$1")" > "${ZCPO_STOP_FILE}.partial" && mv -f "${ZCPO_STOP_FILE}.partial" "${ZCPO_STOP_FILE}"; } \
            || log "cannot write ${ZCPO_STOP_FILE}: training goes on until Slurm stops the job"
    else
        log "$1: stopping before training; the job requeues itself"
        [[ -z "${STEP_PID}" ]] || kill -TERM "${STEP_PID}" 2>/dev/null || true
    fi
}
trap 'on_stop_signal USR1' USR1
trap 'on_stop_signal TERM' TERM

# Run one job step, srun ARGS... (--output FILE first: its standard output), in the background and wait
# for it, so that a stop signal is handled while it runs (bash runs traps only between commands);
# its exit code in STEP_EXIT_CODE.
run_step() {
    if [[ "$1" == --output ]]; then
        srun "${@:3}" > "$2" &
    else
        srun "$@" &
    fi
    STEP_PID=$!
    wait_for_process "${STEP_PID}"
    STEP_PID=""
}

# Wait for the background process $1 until it exits (a trapped signal interrupts `wait`); its exit code
# in STEP_EXIT_CODE (bash keeps it for another `wait`).
wait_for_process() {
    while kill -0 "$1" 2>/dev/null; do wait "$1" || true; done
    STEP_EXIT_CODE=0
    wait "$1" || STEP_EXIT_CODE=$?
}

# After run_step: go on if the step succeeded; requeue if the job is being stopped (a stop signal
# came, or the step's tasks were terminated: Slurm's SIGTERM to the steps); else fail naming $1.
check_step() {
    (( STEP_EXIT_CODE == 0 )) && [[ -z "${ZCPO_STOP_SIGNAL:-}" ]] && return 0
    if [[ -n "${ZCPO_STOP_SIGNAL:-}" ]] || (( STEP_EXIT_CODE == TERMINATED_EXIT_CODE )); then
        ZCPO_STOP_SIGNAL=${ZCPO_STOP_SIGNAL:-TERM}
        requeue "${ZCPO_STOP_SIGNAL} during $1"
    fi
    die "$1 failed (exit ${STEP_EXIT_CODE})"
}

# Stop the servers and requeue this job: Slurm ends this script and starts the job again (after a
# delay, under the same job id; the output file continues), and checkpoint.resume=auto resumes.
requeue() {
    stop_sglang
    log "$1: requeueing job ${SLURM_JOB_ID} (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
    trap - EXIT
    trap '' USR1 TERM  # nothing stops the requeue now (its own TERM to this script comes next)
    scontrol requeue "${SLURM_JOB_ID}" || die "scontrol requeue ${SLURM_JOB_ID} failed: submit the job again with the same RUN_DIR to resume"
    exit 0
}

zcpo_job_main() {
    [[ -n "${SLURM_JOB_ID:-}" ]] || die "run this script with sbatch"
    [[ -f "${REPO_DIR}/examples/common/sglang_node.py" ]] || die "REPO_DIR=${REPO_DIR} is not the repository root (submit from it or set REPO_DIR)"
    local stale
    for stale in TRAIN_TP TRAIN_PP TRAIN_CP TRAIN_EP; do  # a second source of the layout could disagree
        [[ -z "${!stale:-}" ]] || die "${stale} is not read: the layout is parallel.* of ${CONFIG}; set it there or with ZCPO_OVERRIDES (e.g. parallel.tensor=8 parallel.pipeline=1)"
    done
    [[ -z "${ZCPO_STOP_SIGNAL:-}" ]] || requeue "${ZCPO_STOP_SIGNAL} while the job started"
    local gpus_per_node="${SLURM_GPUS_ON_NODE:-8}"
    local cpus_per_node="${SLURM_CPUS_ON_NODE:-$(nproc)}"
    (( ${SLURM_RESTART_COUNT:-0} == 0 )) || log "restart ${SLURM_RESTART_COUNT} of job ${SLURM_JOB_ID}: resuming from the newest checkpoint in ${RUN_DIR}/checkpoints"

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
    # A step of one task on one node (the job may carry --ntasks-per-node, which srun would pass on).
    local one_task=(--nodes=1 --ntasks=1 --ntasks-per-node=1)

    # ------------------------------------------------------------------ 1. checkpoint conversion
    if [[ ! -f "${MEGATRON_CKPT}/model_config.json" ]]; then
        [[ -z "${ZCPO_STOP_SIGNAL:-}" ]] || requeue "${ZCPO_STOP_SIGNAL} before the checkpoint conversion"
        # Into a directory of this job's own, renamed once complete: a stopped conversion, or one of
        # another job converting at the same time, is never mistaken for a checkpoint.
        local partial="${MEGATRON_CKPT}.partial-${SLURM_JOB_ID}"
        log "converting ${HF_MODEL} -> ${MEGATRON_CKPT}"
        rm -rf "${partial}"
        local convert_args=()
        read -r -a convert_args <<< "${CONVERT_ARGS:-}"
        run_step "${runtime[@]}" "${one_task[@]}" --nodelist="${train_hosts[0]}" --gpus-per-node="${gpus_per_node}" \
            --cpus-per-task="${cpus_per_node}" \
            python tools/convert_hf_to_megatron.py --hf-dir "${HF_MODEL}" --out "${partial}" "${convert_args[@]}"
        (( STEP_EXIT_CODE == 0 )) && [[ -z "${ZCPO_STOP_SIGNAL:-}" ]] || rm -rf "${partial}"
        check_step "the checkpoint conversion"
        if ! mv -T "${partial}" "${MEGATRON_CKPT}" 2>/dev/null; then
            rm -rf "${partial}"
            [[ -f "${MEGATRON_CKPT}/model_config.json" ]] || die "cannot rename the converted checkpoint to ${MEGATRON_CKPT}: remove what is there"
            log "${MEGATRON_CKPT} was converted by another job meanwhile: using it"
        fi
    fi

    # ------------------------------------------------------------------ 2. addresses and config check
    local sglang_args=(--model-path "${HF_MODEL}" --nodes "${rollout_list}" --tp-size "${ROLLOUT_TP}"
                       --gpus-per-node "${gpus_per_node}" --python "${SGLANG_PYTHON}"
                       --log-dir "${RUN_DIR}/sglang_logs")
    local node_args=()
    read -r -a node_args <<< "${SGLANG_NODE_ARGS:-}"
    sglang_args+=("${node_args[@]}")
    local server_urls router_url
    if [[ -n "${attach}" ]]; then
        server_urls=$(json_list "${SGLANG_SERVER_URLS}")
        router_url="${SGLANG_ROUTER_URL:-null}"
    else
        run_step --output "${RUN_DIR}/sglang_plan.txt" "${runtime[@]}" "${one_task[@]}" --nodelist="${rollout_hosts[0]}" \
            python examples/common/sglang_node.py "${sglang_args[@]}" --print
        check_step "planning the SGLang servers"
        { read -r server_urls; read -r router_url; } < "${RUN_DIR}/sglang_plan.txt"
        [[ "${server_urls}" == '["http'* && "${router_url}" == http* ]] || die "unexpected server plan: $(cat "${RUN_DIR}/sglang_plan.txt")"
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
    run_step --output "${RUN_DIR}/config.resolved.yaml" "${runtime[@]}" "${one_task[@]}" --nodelist="${train_hosts[0]}" \
        --gpus-per-node="${gpus_per_node}" \
        zcpo train "${CONFIG}" "${overrides[@]}" --dry-run --nproc "${train_gpus}"
    check_step "the config check (zcpo train --dry-run)"
    log "config valid: ${RUN_DIR}/config.resolved.yaml"

    # ------------------------------------------------------------------ 3. SGLang servers + router
    if [[ -z "${attach}" ]]; then
        # A fresh key per job: servers and router refuse requests without it (401); the training
        # tasks inherit it from this environment and send it (rollout.sglang.client.api_key).
        ZCPO_SGLANG_API_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
        export ZCPO_SGLANG_API_KEY
        trap stop_sglang EXIT
        # the step's output, appended after the earlier attempts' (wait_for_health reads this attempt's part)
        SGLANG_LOG_START=$(stat -c %s "${RUN_DIR}/sglang_step.log" 2>/dev/null || echo 0)
        # --disable-status: srun passes a SIGINT on to the tasks (stop_sglang), instead of printing their status
        srun "${sglang_runtime[@]}" ${colocated:+--overlap} --disable-status --nodes="${#rollout_hosts[@]}" \
            --ntasks="${#rollout_hosts[@]}" --ntasks-per-node=1 --nodelist="${rollout_list}" \
            --gpus-per-node="${gpus_per_node}" --cpus-per-task="${cpus_per_node}" \
            "${node_python}" examples/common/sglang_node.py "${sglang_args[@]}" \
            --run-config "${RUN_DIR}/config.resolved.yaml" >> "${RUN_DIR}/sglang_step.log" 2>&1 &
        SGLANG_STEP_PID=$!
    fi
    wait_for_health "${server_urls}" "${router_url/#null/}"

    # ------------------------------------------------------------------ 4. training
    [[ -z "${ZCPO_STOP_SIGNAL:-}" ]] || requeue "${ZCPO_STOP_SIGNAL} before training"
    # MASTER_PORT: every task derives it from the job id (megatron_zcpo/megatron/initialize.py,
    # job_master_port: 20000-28999, never the router's or a server's port)
    export MASTER_ADDR="${train_hosts[0]}"
    export CUDA_DEVICE_MAX_CONNECTIONS=1          # megatron-core: TP/SP communication ordering
    if [[ -n "${colocated}" ]]; then
        unset PYTORCH_CUDA_ALLOC_CONF  # expandable segments break the CUDA IPC handles of the weight push
    else
        export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # sequence lengths vary step to step
    fi
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
    log "training: zcpo train ${CONFIG} (MASTER_ADDR=${MASTER_ADDR})"
    # The stop request of on_stop_signal, read by rank 0 at each safe point (megatron_zcpo/training/
    # preemption.py); this script runs on the first training node, where rank 0 runs.
    export ZCPO_STOP_FILE="${RUN_DIR}/.stop_request-${SLURM_JOB_ID}"
    rm -f "${ZCPO_STOP_FILE}"
    # --wait: once a task exits the others get 120 s, then the step ends (a crashed rank does not leave
    # the others waiting in a collective). Not --kill-on-bad-exit: it would kill the ranks still
    # leaving after another's exit 75, and report that kill instead of 75.
    TRAINING=yes
    [[ -z "${ZCPO_STOP_SIGNAL:-}" ]] || on_stop_signal "${ZCPO_STOP_SIGNAL}"  # came since the check above
    srun "${runtime[@]}" ${colocated:+--overlap} --nodes="${TRAIN_NODES}" --ntasks="${train_gpus}" \
        --ntasks-per-node="${gpus_per_node}" --nodelist="${train_list}" \
        --gpus-per-node="${gpus_per_node}" --cpus-per-task=$(( cpus_per_node / gpus_per_node )) --wait=120 \
        zcpo train "${CONFIG}" "${overrides[@]}" &
    wait_for_process $!
    TRAINING=""
    rm -f "${ZCPO_STOP_FILE}"
    if (( STEP_EXIT_CODE == PREEMPTED_EXIT_CODE )); then
        requeue "training stopped at a checkpoint (exit ${STEP_EXIT_CODE})"
    elif (( STEP_EXIT_CODE == TERMINATED_EXIT_CODE )); then  # a rank died of Slurm's TERM while it started
        requeue "the training step was terminated (exit ${STEP_EXIT_CODE}): resuming from the newest checkpoint"
    fi
    (( STEP_EXIT_CODE == 0 )) || die "training failed (exit ${STEP_EXIT_CODE})"
    log "training finished"
}

# Poll every server's /health_generate and the router's /readiness until all answer 200 (what the
# client checks too): sglang-router 0.2.0 answers its own /health_generate with 503, always. A stop
# signal to this script, or one that reached the SGLang step (sglang_node.py reports it: a
# preemption's SIGTERM to the steps), ends the wait and requeues the job.
wait_for_health() {
    local urls deadline=$(( SECONDS + ${SGLANG_STARTUP_TIMEOUT:-1800} )) url waiting
    read -r -a urls <<< "$(echo "$1" | tr -d '[]"' | tr ',' ' ' | sed 's,[^ ][^ ]*,&/health_generate,g') ${2:+$2/readiness}"
    while :; do
        if [[ -z "${ZCPO_STOP_SIGNAL:-}" && -n "${SGLANG_STEP_PID}" ]] \
            && tail -c +$(( SGLANG_LOG_START + 1 )) "${RUN_DIR}/sglang_step.log" | grep -q '^sglang_node: received SIG'; then
            ZCPO_STOP_SIGNAL=TERM
        fi
        [[ -z "${ZCPO_STOP_SIGNAL:-}" ]] || requeue "${ZCPO_STOP_SIGNAL} while the SGLang servers started"
        waiting=()
        for url in "${urls[@]}"; do
            curl -sf -o /dev/null --max-time 30 "${url}" || waiting+=("${url}")
        done
        (( ${#waiting[@]} == 0 )) && { log "SGLang: ${#urls[@]} endpoints healthy"; return 0; }
        [[ -z "${SGLANG_STEP_PID}" ]] || kill -0 "${SGLANG_STEP_PID}" 2>/dev/null || die "the SGLang step exited; see ${RUN_DIR}/sglang_step.log and ${RUN_DIR}/sglang_logs/"
        (( SECONDS < deadline )) || die "not healthy after ${SGLANG_STARTUP_TIMEOUT:-1800}s: ${waiting[*]}"
        sleep "${SGLANG_HEALTH_POLL_S:-15}"
    done
}

# Stop the SGLang step: SIGINT to its tasks (through srun, --disable-status), on which sglang_node.py
# stops its servers and router; after a minute srun ends the step (SIGKILL to its tasks).
stop_sglang() {
    [[ -n "${SGLANG_STEP_PID}" ]] && kill -0 "${SGLANG_STEP_PID}" 2>/dev/null || return 0
    log "stopping the SGLang servers"
    kill -INT "${SGLANG_STEP_PID}" 2>/dev/null || true
    local waited=0
    while kill -0 "${SGLANG_STEP_PID}" 2>/dev/null && (( waited++ < 60 )); do sleep 1; done
    kill -TERM "${SGLANG_STEP_PID}" 2>/dev/null || true
    wait_for_process "${SGLANG_STEP_PID}"
    SGLANG_STEP_PID=""
}
