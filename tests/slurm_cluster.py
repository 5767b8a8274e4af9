"""A real Slurm cluster on this host for integration tests: one slurmctld and two slurmd "nodes".

The session fixture `slurm_cluster` renders a slurm.conf into a fresh temporary directory, starts munged (unless a
working one is already there), slurmctld and two slurmd on free TCP ports, waits until both nodes are idle, and yields
a `SlurmCluster` whose `env` points the client commands (sbatch, srun, scontrol, ...) at it. Teardown cancels the
cluster's jobs and stops only the daemons this module started. It skips (see `slurm_missing`) where Slurm cannot run:
not root, or the Debian packages `slurmctld slurmd slurm-client munge` are not installed.

The configuration avoids everything a container lacks (no systemd, no cgroups: /proc process tracking, no task
binding, no accounting) and is tuned for tests: a requeued job may start again after about 12 s (credential lifetime
10 s, scheduler pass every 2 s) instead of the default 180 s, and finished jobs stay visible to `scontrol show job`
for 300 s. State is fresh on every start, so job ids begin at 1 again.

Use it from a test module with `from tests.slurm_cluster import slurm_cluster` (pytest then finds the fixture).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmforge.launch.submit import TERMINAL_STATES

CLIENT_BINARIES = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
DAEMON_BINARIES = ("slurmctld", "slurmd", "munged", "munge", "unmunge")
NODE_NAMES = ("lmf-node1", "lmf-node2")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_LINE = f"127.0.0.1 {' '.join(NODE_NAMES)} # lmforge-test-slurm"
MUNGE_DIRS = (Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge"))
MUNGE_KEY = Path("/etc/munge/munge.key")
START_TIMEOUT = 60.0  # seconds until both nodes must be idle
STOP_TIMEOUT = 10.0  # seconds a daemon gets between SIGTERM and SIGKILL
CANCEL_TIMEOUT = 15.0  # seconds the cancelled jobs get to leave the queue (KillWait=5 plus slack)
COMMAND_TIMEOUT = 30.0  # seconds any one client command may take
TOPOLOGY_FIELDS = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
# Variables that sbatch/srun/salloc read as options; inherited from an enclosing job they would change what we submit.
INHERITED_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCANCEL_")


def slurm_missing() -> str | None:
    """Why a local Slurm cluster cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (SlurmUser=root; munged is started as the munge user)"
    for name in CLIENT_BINARIES + DAEMON_BINARIES:
        if shutil.which(name) is None:
            return f"{name} is not on PATH (apt-get install slurmctld slurmd slurm-client munge provides it)"
    return None


@dataclass
class SlurmCluster:
    """A running local cluster: its slurm.conf, the environment its client commands need, and its node names."""

    conf: Path
    env: dict[str, str]
    nodes: list[str]

    @property
    def base(self) -> Path:
        """The cluster's directory: etc/slurm.conf, state/, spool/<node>/, run/ and log/ (daemon logs) below it."""
        return self.conf.parent.parent

    def run(self, args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (e.g. `["sbatch", "--parsable", ...]`) against this cluster and capture its
        output as text; keyword arguments go to `subprocess.run` and override these defaults."""
        options: dict[str, Any] = {"env": self.env, "text": True, "capture_output": True, "timeout": COMMAND_TIMEOUT}
        options.update(kw)
        return subprocess.run(args, **options)

    def sbatch(self, args: list[str]) -> str:
        """Submit a batch job with `sbatch --parsable *args` and return its id (fails the test if sbatch does)."""
        proc = self.run(["sbatch", "--parsable", *args])
        assert proc.returncode == 0, f"sbatch {args} exited {proc.returncode}: {proc.stderr.strip()}"
        return proc.stdout.strip().split(";")[0]

    def show_job(self, job_id: str) -> str:
        """The one-line `scontrol show job -o` record of a job ("" when scontrol does not know it)."""
        proc = self.run(["scontrol", "show", "job", "-o", job_id])
        return proc.stdout.splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""

    def job_field(self, job_id: str, name: str) -> str:
        """One `Name=value` field of a job's record, e.g. `JobState`, `Restarts`, `ExitCode`, `NodeList`."""
        line = self.show_job(job_id)
        match = re.search(rf"(?:^|\s){re.escape(name)}=(\S*)", line)
        assert match is not None, f"job {job_id} has no field {name}: {line or '<no record>'}"
        return match.group(1)

    def state(self, job_id: str) -> str:
        """The job's state (`PENDING`, `RUNNING`, `REQUEUED`, `COMPLETED`, ...)."""
        return self.job_field(job_id, "JobState")

    def wait(self, job_id: str, timeout: float) -> tuple[str, int]:
        """Poll the job every 0.25 s until it reaches a terminal state (a requeued job passes through REQUEUED and
        PENDING and is waited for) and return `(state, exit_code)`, the exit code being `a` of `ExitCode=a:b`.
        Raises AssertionError with the last record seen if that takes longer than `timeout` seconds."""
        deadline = time.monotonic() + timeout
        line = ""
        while True:
            line = self.show_job(job_id) or line
            state = re.search(r"(?:^|\s)JobState=(\S+)", line)
            if state is not None and state.group(1) in TERMINAL_STATES:
                exit_code = re.search(r"(?:^|\s)ExitCode=(\d+):\d+", line)
                return state.group(1), int(exit_code.group(1)) if exit_code else -1
            if time.monotonic() >= deadline:
                raise AssertionError(f"job {job_id} not finished after {timeout:.0f} s: {line or '<no record>'}")
            time.sleep(0.25)


def _free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that nothing listens on now (held open together so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]


def _node_hardware() -> tuple[str, int]:
    """The CPU topology fields of `slurmd -C` (so slurmd finds its node as configured) and RealMemory in MB (90% of
    what slurmd detects, so a node is never drained for having less memory than configured)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=True).stdout
    fields = dict(item.split("=", 1) for item in out.splitlines()[0].split() if "=" in item)
    topology = " ".join(f"{name}={fields[name]}" for name in TOPOLOGY_FIELDS if name in fields)
    memory = int(fields.get("RealMemory", "1024"))
    return topology or f"CPUs={os.cpu_count() or 1}", max(memory * 9 // 10, 1)


def _render_conf(base: Path, ctld_port: int, node_ports: list[int]) -> str:
    """The slurm.conf text for a cluster living under `base`."""
    host = socket.gethostname().split(".")[0]
    topology, memory = _node_hardware()
    nodes = [
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} {topology} RealMemory={memory}"
        for name, port in zip(NODE_NAMES, node_ports, strict=True)
    ]
    lines = [
        "ClusterName=lmforge-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={node_ports[0]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # The credential lifetime is also how long a requeued job waits before it may start again (default 120 s).
        "AuthInfo=cred_expire=10",
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MailProg=/bin/true",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "ReturnToService=2",
        "JobRequeue=1",
        "KillWait=5",
        "MinJobAge=300",
        "InactiveLimit=0",
        f"StateSaveLocation={base}/state",
        f"SlurmdSpoolDir={base}/spool/%n",
        f"SlurmctldPidFile={base}/run/slurmctld.pid",
        f"SlurmdPidFile={base}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={base}/log/slurmctld.log",
        f"SlurmdLogFile={base}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        *nodes,
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def _munge_works() -> bool:
    """Whether a munged answers on the default socket (a credential made by `munge -n` decodes with `unmunge`)."""
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=5).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _prepare_munge() -> None:
    """What munged needs and a container without systemd lacks: its directories owned by munge, and a key."""
    for directory in MUNGE_DIRS:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.chown(directory, "munge", "munge")
    if not MUNGE_KEY.is_file() or MUNGE_KEY.stat().st_size == 0:
        MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mungekey", "--create", f"--keyfile={MUNGE_KEY}", "--force"], check=True, timeout=30)
        shutil.chown(MUNGE_KEY.parent, "munge", "munge")
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.parent.chmod(0o700)
        MUNGE_KEY.chmod(0o400)


def _resolves(name: str) -> bool:
    """Whether a host name resolves (as a job's `scontrol show hostnames` output must for a rendezvous)."""
    try:
        socket.getaddrinfo(name, None)
    except socket.gaierror:
        return False
    return True


def _add_hosts_line() -> bool:
    """Append `HOSTS_LINE` to /etc/hosts unless the node names resolve already; True when it was appended. Appends in
    place (/etc/hosts may be a bind mount, which a rename would not replace)."""
    if all(_resolves(name) for name in NODE_NAMES):
        return False
    text = HOSTS_FILE.read_text()
    with HOSTS_FILE.open("a") as f:
        f.write(("" if text.endswith("\n") or not text else "\n") + HOSTS_LINE + "\n")
    return True


def _remove_hosts_line() -> None:
    """Remove exactly the line `_add_hosts_line` appended, rewriting /etc/hosts in place."""
    lines = HOSTS_FILE.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.rstrip("\n") != HOSTS_LINE]
    if len(kept) != len(lines):
        with HOSTS_FILE.open("r+") as f:
            f.write("".join(kept))
            f.truncate()


def _tail(path: Path, n: int = 20) -> str:
    """The last `n` lines of a log file, headed by its name."""
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError as e:
        lines = [f"<{e}>"]
    return f"--- {path}\n" + "\n".join(lines)


def _start_daemon(args: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
    """Start a foreground daemon in a session of its own, its stdout and stderr appended to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw
        )


def _stop_daemons(daemons: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the daemons, give them `STOP_TIMEOUT` seconds together, SIGKILL the rest, and reap them all."""
    for proc in daemons:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    for proc in daemons:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cancel_jobs(cluster: SlurmCluster) -> None:
    """Cancel every job of the cluster and wait (bounded) until none is left running or completing."""
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        queued = cluster.run(["squeue", "-h", "-o", "%i"], timeout=5)
        jobs = queued.stdout.split() if queued.returncode == 0 else []
        if not jobs:
            return
        cluster.run(["scancel", *jobs], timeout=10)
        deadline = time.monotonic() + CANCEL_TIMEOUT
        while time.monotonic() < deadline:
            active = cluster.run(["squeue", "-h", "-t", "RUNNING,COMPLETING", "-o", "%i"], timeout=5)
            if active.returncode != 0 or not active.stdout.strip():
                return
            time.sleep(0.2)


def _wait_idle(cluster: SlurmCluster, daemons: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    """Wait until `sinfo` lists every node idle; fail with the daemons' log tails after `START_TIMEOUT` seconds or as
    soon as a daemon exits."""
    deadline = time.monotonic() + START_TIMEOUT
    seen = ""
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=5)
            seen = proc.stdout.strip() or proc.stderr.strip() or seen
            states = dict(line.split()[:2] for line in proc.stdout.splitlines() if len(line.split()) >= 2)
            if all(states.get(node) == "idle" for node in cluster.nodes):
                return
        exited = [p.args for p in daemons if p.poll() is not None]
        if exited or time.monotonic() >= deadline:
            why = f"exited: {exited}" if exited else f"nodes not idle after {START_TIMEOUT:.0f} s"
            tails = "\n".join(_tail(log) for log in logs)
            raise RuntimeError(f"local Slurm cluster did not start ({why}); sinfo: {seen or '<no answer>'}\n{tails}")
        time.sleep(0.2)


@contextlib.contextmanager
def local_slurm_cluster(base: Path) -> Iterator[SlurmCluster]:
    """Start a two-node cluster with its configuration, state, spool and logs under `base`, yield it, and stop what
    was started (also when the start fails halfway). Call `slurm_missing()` first."""
    for sub in ("etc", "state", "run", "log", *(f"spool/{name}" for name in NODE_NAMES)):
        (base / sub).mkdir(parents=True, exist_ok=True)
    ctld_port, *node_ports = _free_ports(1 + len(NODE_NAMES))
    conf = base / "etc" / "slurm.conf"
    conf.write_text(_render_conf(base, ctld_port, node_ports))
    env = {key: value for key, value in os.environ.items() if not key.startswith(INHERITED_PREFIXES)}
    cluster = SlurmCluster(conf=conf, env={**env, "SLURM_CONF": str(conf)}, nodes=list(NODE_NAMES))
    munged: subprocess.Popen[bytes] | None = None
    daemons: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    hosts_added = False
    try:
        if not _munge_works():
            _prepare_munge()
            logs.append(base / "log" / "munged.stderr")
            # munged refuses to run as root ("PRNG seed dir is insecure"); as a child of ours (not via runuser, which
            # forks and takes 2 s to pass on SIGTERM) it can be stopped and reaped at once.
            munged = _start_daemon(["munged", "--foreground"], logs[-1], user="munge", group="munge", extra_groups=[])
            deadline = time.monotonic() + 10
            while not _munge_works():
                if munged.poll() is not None or time.monotonic() >= deadline:
                    raise RuntimeError(f"munged did not come up\n{_tail(logs[-1])}")
                time.sleep(0.1)
        logs += [base / "log" / "slurmctld.stderr", base / "log" / "slurmctld.log"]
        daemons.append(_start_daemon(["slurmctld", "-D", "-f", str(conf)], logs[-2]))
        for name in NODE_NAMES:
            logs += [base / "log" / f"slurmd-{name}.stderr", base / "log" / f"slurmd-{name}.log"]
            daemons.append(_start_daemon(["slurmd", "-D", "-N", name, "-f", str(conf)], logs[-2]))
        hosts_added = _add_hosts_line()
        _wait_idle(cluster, daemons, logs)
        yield cluster
    finally:
        try:
            if daemons:
                _cancel_jobs(cluster)
            # The slurmds, then slurmctld, then munged: each still has what it talks to while it shuts down.
            _stop_daemons(daemons[1:])
            _stop_daemons(daemons[:1])
            _stop_daemons([munged] if munged is not None else [])
        finally:
            if hosts_added:
                _remove_hosts_line()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A local two-node Slurm cluster for the whole test session (skips where Slurm cannot run)."""
    reason = slurm_missing()
    if reason is not None:
        pytest.skip(reason)
    with local_slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
