#!/usr/bin/env bash
# Install what the one-machine Slurm cluster of the tests needs (megatron_zcpo/testing/slurm_cluster.py,
# tests/cli/test_example_jobs_slurm.py): Debian's Slurm 22.05 (slurmctld, slurmd, the client commands)
# and munge. Nothing is started or configured here: the cluster writes its own munge key and
# slurm.conf under a temporary directory, and the packages' services stay off. Needs apt (Debian 12)
# and root, else sudo; does nothing when the programs are already installed.
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge)
programs=(slurmctld slurmd munged sbatch srun scontrol scancel squeue sinfo)

missing=()
for program in "${programs[@]}"; do
    PATH="${PATH}:/usr/sbin:/sbin" command -v "${program}" >/dev/null || missing+=("${program}")
done
(( ${#missing[@]} == 0 )) && exit 0

SUDO=""
[[ "$(id -u)" == 0 ]] || SUDO=sudo
if ! command -v apt-get >/dev/null || { [[ -n "${SUDO}" ]] && ! command -v sudo >/dev/null; }; then
    echo "tools/install_slurm.sh: ${missing[*]} missing; install as root on Debian: apt-get install ${packages[*]}" >&2
    exit 1
fi
echo "installing ${packages[*]} (for the Slurm tests)"
# The packages' services must not start (the system's munged, slurmctld, slurmd): Debian's
# policy-rc.d says so to their install scripts, for the time of the install if none is there.
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    ${SUDO} sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d'
    trap '${SUDO} rm -f /usr/sbin/policy-rc.d' EXIT
fi
${SUDO} apt-get update -qq
${SUDO} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
