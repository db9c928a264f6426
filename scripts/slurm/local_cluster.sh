#!/usr/bin/env bash
# A throwaway single-node Slurm (munged + slurmctld + slurmd as root) to test the sbatch
# scripts on a dev or CI machine. Everything lives under $SLURM_LAB; stop only touches the
# PIDs it started.
#
#   bash scripts/slurm/local_cluster.sh install   # Debian packages: slurmctld slurmd slurm-client munge
#   bash scripts/slurm/local_cluster.sh up        # start (idempotent); prints the SLURM_CONF to export
#   bash scripts/slurm/local_cluster.sh down      # stop by PID file, cancel jobs first
#
# SLURM_LAB (default /tmp/hettp-slurm), SLURM_CPUS (default nproc), SLURM_UP_TIMEOUT (s, 60).
set -euo pipefail
LAB=${SLURM_LAB:-/tmp/hettp-slurm}
CONF=$LAB/slurm.conf
SOCK=$LAB/munge/munge.sock
say() { echo "[local_cluster $(date +%T)] $*" >&2; }

# a PID file's process is alive (a zombie is dead: nothing reaps orphans quickly in containers)
running() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] &&
    ! grep -qs '^State:[[:space:]]*Z' "/proc/$pid/status"
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
     command -v sbatch >/dev/null && command -v munged >/dev/null; then
    say "slurm and munge already installed"; return 0
  fi
  command -v apt-get >/dev/null || { say "no apt-get: install slurmctld, slurmd, slurm-client and munge yourself"; exit 1; }
  local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  say "installing slurmctld slurmd slurm-client munge (Debian)"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
  local host cpus mem
  host=$(hostname -s)
  cpus=${SLURM_CPUS:-$(nproc)}
  mem=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
  cat > "$CONF.new" <<EOF
ClusterName=hettp
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
SlurmctldPort=${SLURM_CTLD_PORT:-6817}
SlurmdPort=${SLURM_D_PORT:-6818}
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool
SlurmctldPidFile=$LAB/slurmctld.pid
SlurmdPidFile=$LAB/slurmd.pid
SlurmctldLogFile=$LAB/slurmctld.log
SlurmdLogFile=$LAB/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  if cmp -s "$CONF.new" "$CONF"; then rm "$CONF.new"; return 1; fi
  mv "$CONF.new" "$CONF"
}

up() {
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || { say "$tool not installed (run: $0 install)"; exit 1; }
  done
  mkdir -p "$LAB/munge" "$LAB/state" "$LAB/spool"
  chmod 711 "$LAB" "$LAB/munge"  # munged refuses a socket path others cannot traverse
  if ! running "$LAB/munge/munged.pid" munged; then
    [ -s "$LAB/munge/munge.key" ] || { (umask 077; head -c 1024 /dev/urandom > "$LAB/munge/munge.key"); }
    chmod 400 "$LAB/munge/munge.key"
    rm -f "$SOCK" "$SOCK.lock"
    munged --socket="$SOCK" --key-file="$LAB/munge/munge.key" --pid-file="$LAB/munge/munged.pid" \
      --log-file="$LAB/munge/munged.log" --seed-file="$LAB/munge/munged.seed"
    for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done
  fi
  munge -S "$SOCK" -n | unmunge -S "$SOCK" >/dev/null || { say "munge self-test failed: $LAB/munge/munged.log"; exit 1; }
  export SLURM_CONF=$CONF
  local changed=0
  write_conf && changed=1
  if running "$LAB/slurmctld.pid" slurmctld; then
    [ $changed = 1 ] && scontrol reconfigure
  else
    slurmctld -f "$CONF" -i
  fi
  running "$LAB/slurmd.pid" slurmd || slurmd -f "$CONF"
  local host state="" end=$(( $(date +%s) + ${SLURM_UP_TIMEOUT:-60} ))
  host=$(hostname -s)
  while [ "$(date +%s)" -lt "$end" ]; do
    state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
    case "$state" in
      idle|mix|alloc) say "node $host is $state"; echo "export SLURM_CONF=$CONF"; return 0 ;;
      down*|drain*|fail*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.3
  done
  say "node $host not ready (state '$state'); logs: $LAB/slurmctld.log $LAB/slurmd.log"
  exit 1
}

stop_pid() {  # pidfile comm
  running "$1" "$2" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do running "$1" "$2" || break; sleep 0.1; done
  running "$1" "$2" && kill -KILL "$pid" 2>/dev/null
  rm -f "$1"
  say "stopped $2 ($pid)"
}

down() {
  export SLURM_CONF=$CONF
  if running "$LAB/slurmctld.pid" slurmctld && [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
    scancel --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  stop_pid "$LAB/slurmd.pid" slurmd
  stop_pid "$LAB/slurmctld.pid" slurmctld
  stop_pid "$LAB/munge/munged.pid" munged
}

case "${1:-}" in
  install) install_packages ;;
  up) up ;;
  down) down ;;
  *) echo "usage: $0 install|up|down" >&2; exit 2 ;;
esac
