#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (Debian/Ubuntu, as root), for tests/test_slurm.py:
#   bash scripts/slurm_one_node.sh        # installs slurm-wlm + munge, starts munged, slurmctld, slurmd
# Idempotent: an answering cluster is left as it is. Exit 1 (and the test skips) where it cannot run.
set -euo pipefail
if sinfo -h >/dev/null 2>&1; then echo "slurm: a cluster answers already"; exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then echo "slurm: needs root and apt-get"; exit 1; fi
if ! command -v slurmctld >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi
host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))   # MiB, 80% of RAM
mkdir -p /etc/munge /var/log/munge /run/munge /var/lib/munge /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
[ -f /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
chown -R munge:munge /etc/munge /var/log/munge /run/munge /var/lib/munge
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=finetune
SlurmctldHost=${host}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
NodeName=${host} CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld -c -i
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 30); do
  if sinfo -h -o %T 2>/dev/null | grep -q idle; then echo "slurm: one-node cluster up (${host}, ${cpus} CPUs)"; exit 0; fi
  sleep 1
done
echo "slurm: the cluster did not come up (see /var/log/slurm/)"; exit 1
