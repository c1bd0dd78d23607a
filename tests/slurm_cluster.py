"""A real two-node Slurm cluster on this host, in a temporary folder, for tests/test_slurm.py.

munged (its own key and socket), slurmctld and two slurmd daemons (-N n1, -N n2) sharing the host
with NodeAddr=127.0.0.1 and distinct ports: Slurm node names are not host names here, just as on a
cluster where they need not resolve. Every daemon is stopped by its pid in stop().
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")


class ClusterError(RuntimeError):
    pass


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def missing_tools() -> list[str]:
    return [d for d in DAEMONS if not shutil.which(d) and not os.path.exists(f"/usr/sbin/{d}")]


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Cluster:
    def __init__(self, root: str):
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.pidfiles: list[str] = []

    def _run(self, *cmd: str) -> None:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if proc.returncode:
            raise ClusterError(f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}")

    def start(self) -> Cluster:
        if os.geteuid() != 0:
            raise ClusterError("the Slurm test cluster runs its daemons as root")
        if missing_tools():
            raise ClusterError(f"not installed: {', '.join(missing_tools())} (apt-get install slurm-wlm munge)")
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        key, sock = os.path.join(r, "munge", "munge.key"), os.path.join(r, "munge", "munge.sock")
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
        os.chmod(key, 0o400)
        munge_pid = os.path.join(r, "munge", "munged.pid")
        self.pidfiles.append(munge_pid)
        self._run(_exe("munged"), "--force", f"--key-file={key}", f"--socket={sock}", f"--pid-file={munge_pid}",
                  f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/seed")
        ctld, n1, n2 = _free_ports(3)
        host = socket.gethostname().split(".")[0]
        # task/affinity with TaskPluginParam=Cores binds each task to the CPUs its step gave it, as sites that
        # bind tasks to cores do: a step that gets fewer CPUs than its job asked then shows (srun no longer
        # inherits --cpus-per-task since 22.05: one CPU per task). Slurm's default auto-binding leaves a task
        # that is alone on its node the step's whole share of the node, and would hide it. Both nodes claim
        # the host's first two CPUs (at most what it has: more would drain them)
        cpus = min(2, len(os.sched_getaffinity(0)))
        # MinJobAge=4: `sbatch --wait` sleeps 2 s, then x4 while the sleep is under MinJobAge/2 and 32 s
        # (sbatch.c _job_wait), so Slurm's default (300) polls at 2, 10, 42 s and a 12 s job holds the test
        # 42 s; at 4 it polls every 2 s, and a finished job's record (what scontrol reads next) stays >= 4 s
        with open(self.conf, "w") as fh:
            fh.write(f"""ClusterName=local
SlurmctldHost={host}
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/ctld.log
SlurmdLogFile={r}/log/d-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=Cores
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
MinJobAge=4
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1} CPUs={cpus} RealMemory=10000 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2} CPUs={cpus} RealMemory=10000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")
        self.pidfiles.append(os.path.join(r, "slurmctld.pid"))
        self._run(_exe("slurmctld"), "-f", self.conf)
        for node in ("n1", "n2"):
            self.pidfiles.append(os.path.join(r, f"slurmd-{node}.pid"))
            self._run(_exe("slurmd"), "-f", self.conf, "-N", node)
        self._wait_idle()
        return self

    def _wait_idle(self, timeout: float = 30) -> None:
        deadline, out = time.time() + timeout, ""
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True,
                                 text=True).stdout
            if sorted(out.split()) == sorted(["n1", "idle", "n2", "idle"]):
                return
            time.sleep(0.5)
        raise ClusterError(f"nodes not idle after {timeout:.0f}s: {out.strip()!r}; logs in {self.root}/log")

    def stop(self) -> None:
        """Cancels the jobs still there (their slurmstepd processes would outlive slurmd), then
        SIGTERMs each daemon by its pid and SIGKILLs whichever is still there after 10 s."""
        if os.path.exists(os.path.join(self.root, "slurmctld.pid")):
            try:
                self._cancel_jobs()
            except subprocess.SubprocessError:  # slurmctld not answering: stop the daemons all the same
                pass
        pids = []
        for path in reversed(self.pidfiles):
            try:
                with open(path) as fh:
                    pids.append(int(fh.read().strip()))
            except (OSError, ValueError):
                continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        for pid in pids:
            while time.time() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


    def _cancel_jobs(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True,
                                  timeout=30).stdout.split()
            if not jobs:
                return
            subprocess.run(["scancel", *jobs], env=self.env, capture_output=True, timeout=30)
            time.sleep(1)


def _alive(pid: int) -> bool:
    try:  # the suite is the daemons' subreaper (tests/conftest.py): a stopped one is its zombie until reaped
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
