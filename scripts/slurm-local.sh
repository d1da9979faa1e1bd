#!/usr/bin/env bash
# Start a one-node SLURM on this machine (localhost), for trying `hydra/launcher=slurm` and for the tests.
# Usage (as root; Debian or Ubuntu; no systemd needed):  bash scripts/slurm-local.sh
# Installs slurm-wlm and munge with apt when missing, writes /etc/slurm/slurm.conf for one node with
# this machine's CPUs and memory, starts munged, slurmctld and slurmd, and waits until `sinfo` shows
# the node idle. Running it again while SLURM is up does nothing. Logs: /var/log/slurm/.
# It never overwrites a slurm.conf it did not write (a real cluster's).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by rlx scripts/slurm-local.sh"
say() { echo "slurm-local: $*"; }
fail() { echo "slurm-local: error: $*" >&2; exit 1; }

# A daemon counts as running only if a live (not zombie) process has that exact name: in some
# sandboxes a stopped daemon lingers as a zombie.
running() { ps -C "$1" -o stat= 2>/dev/null | grep -qv '^Z'; }

node_state() { sinfo -h -N -n localhost -o %t 2>/dev/null | head -n1; }

if command -v sinfo >/dev/null && [[ "$(node_state)" =~ ^(idle|mix|alloc)$ ]]; then
  say "already up (node localhost: $(node_state)); nothing to do"
  exit 0
fi

[[ $(id -u) -eq 0 ]] || fail "run as root (it installs packages and starts munged, slurmctld, slurmd)"

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || fail "slurm-wlm and munge are not installed and apt-get is not available"
  say "installing slurm-wlm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null && apt-get install -y -qq slurm-wlm munge >/dev/null; } ||
    fail "apt-get could not install slurm-wlm and munge"
fi

# munge: the key, its run directory, the daemon (as the munge user, as the package expects).
if [[ ! -s /etc/munge/munge.key ]]; then
  say "creating /etc/munge/munge.key"
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if running munged; then
  say "munged already running"
else
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged --force
fi

# slurm.conf: one node, this machine's CPUs and memory (slurmd drains a node that has less than
# its RealMemory, so leave a little headroom).
cpus=$(nproc)
mem_mb=$(($(awk '/^MemTotal/ {print $2}' /proc/meminfo) / 1024 * 95 / 100))
if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
  fail "$CONF exists and was not written by this script; refusing to overwrite it"
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat >"$CONF.new" <<EOF
$MARK
ClusterName=rlx-local
SlurmctldHost=localhost
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
DefMemPerCPU=$((mem_mb / cpus))
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
if cmp -s "$CONF.new" "$CONF"; then
  rm "$CONF.new"
else
  mv "$CONF.new" "$CONF"
  say "wrote $CONF (1 node: CPUs=$cpus RealMemory=${mem_mb}MB)"
  # daemons started on an older file must re-read it
  for daemon in slurmd slurmctld; do
    if running "$daemon"; then
      say "restarting $daemon (new slurm.conf)"
      kill "$(cat "/run/$daemon.pid")" 2>/dev/null || true
      for _ in $(seq 50); do running "$daemon" || break; sleep 0.1; done
    fi
  done
fi

if running slurmctld; then say "slurmctld already running"; else say "starting slurmctld"; slurmctld; fi
if running slurmd; then say "slurmd already running"; else say "starting slurmd"; slurmd -N localhost; fi

for _ in $(seq 100); do
  state=$(node_state)
  case "$state" in
    idle | mix | alloc) say "up: node localhost $state (sinfo)"; exit 0 ;;
    down* | drain* | drng*) scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true ;;
  esac
  sleep 0.2
done
fail "node localhost did not become idle within 20 s (state: '${state:-none}'); see /var/log/slurm/slurmctld.log and slurmd.log"
