"""A two-host cluster on one machine, for the multi-node tests: real sshd, pdsh and SLURM daemons.

Each host is a network namespace (joined to the other by a veth pair, with addresses that exist
only inside the two namespaces) plus a mount and UTS namespace of its own, held open by a keeper
process: there the host has its own hostname (h1, h2), its own /etc/hosts naming both, and its
own ~/.ssh (a client key, known_hosts and authorized_keys made for this cluster). The file system
is otherwise shared, as a cluster's shared file system is. Every daemon and command of a host
runs inside its namespaces through nsenter; nothing listens outside them except munged's socket,
a file in the cluster's directory.

`ip netns exec` is not used: it remounts /sys, which breaks slurmd. slurmctld needs its own UTS
hostname to accept `SlurmctldHost=h1`. Everything started is stopped, and every namespace, mount
and directory made is removed, when the cluster closes, also after a failure.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

NAMES = ("h1", "h2")
SUBNET = "10.200.0"
SSH_TOOLS = ("ip", "nsenter", "unshare", "sshd", "ssh", "ssh-keygen", "pdsh")
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "scontrol", "srun")
PACKAGES = "slurm-wlm munge openssh-server openssh-client pdsh"  # Debian's names, installed by .ci/run


def missing(tools) -> str | None:
    """Why this machine cannot host the cluster, or None."""
    if os.geteuid() != 0:
        return "network namespaces and sshd need root"
    absent = [tool for tool in tools if shutil.which(tool) is None]
    if absent:
        return f"not installed: {', '.join(absent)} (apt-get install {PACKAGES})"
    probe = f"spds-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Host:
    def __init__(self, name: str, address: str, keeper: subprocess.Popen):
        self.name, self.address, self.keeper = name, address, keeper

    def command(self, argv: list[str], cwd: Path | str | None = None) -> list[str]:
        """argv as run on this host."""
        return ["nsenter", "-t", str(self.keeper.pid), "-n", "-m", "-u", f"--wd={cwd or os.getcwd()}", "--", *argv]

    def run(self, argv: list[str], cwd=None, env=None, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(argv, cwd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kwargs
        )

    def popen(self, argv: list[str], cwd=None, env=None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv, cwd), cwd=cwd, env=env, **kwargs)


class Cluster:
    """`with Cluster(directory, slurm=True) as cluster:` h1 and h2, sshd on both, and with `slurm`
    munged, slurmctld on h1 and slurmd on both (2 CPUs and 2 fake GPUs each)."""

    def __init__(self, directory: Path, slurm: bool = False, kill_wait: int = 30):
        self.dir, self.slurm, self.kill_wait = Path(directory), slurm, kill_wait
        self.tag = f"spds{os.getpid()}"
        self.namespaces: list[str] = []
        self.daemons: list[subprocess.Popen] = []
        self.hosts: list[Host] = []
        self.made: list[Path] = []  # directories outside self.dir that we created, removed at the end
        self.slurm_conf = self.dir / "slurm" / "slurm.conf"

    def __enter__(self) -> "Cluster":
        try:
            self._network()
            self._ssh()
            if self.slurm:
                self._slurm()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def h1(self) -> Host:
        return self.hosts[0]

    @property
    def h2(self) -> Host:
        return self.hosts[1]

    def slurm_env(self, env: dict) -> dict:
        return {**env, "SLURM_CONF": str(self.slurm_conf)}

    # -- the hosts -------------------------------------------------------------------------------

    def _network(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        ns = [f"{self.tag}{name}" for name in NAMES]
        for name in ns:
            _sh("ip", "netns", "add", name)
            self.namespaces.append(name)
        _sh(
            "ip",
            "link",
            "add",
            f"{self.tag}a",
            "netns",
            ns[0],
            "type",
            "veth",
            "peer",
            "name",
            f"{self.tag}b",
            "netns",
            ns[1],
        )
        hosts = self.dir / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} {n}\n" for i, n in enumerate(NAMES)))
        home = Path(pwd.getpwuid(os.getuid()).pw_dir)
        self.ssh_dir = self.dir / "dot-ssh"
        self.ssh_dir.mkdir(mode=0o700)
        if not (home / ".ssh").exists():
            (home / ".ssh").mkdir(mode=0o700)
            self.made.append(home / ".ssh")
        for index, (name, namespace) in enumerate(zip(NAMES, ns)):
            device, address = f"{self.tag}{'ab'[index]}", f"{SUBNET}.{index + 1}"
            _sh("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", device)
            _sh("ip", "-n", namespace, "link", "set", device, "up")
            _sh("ip", "-n", namespace, "link", "set", "lo", "up")
            # The keeper holds the host's mount and UTS namespaces open (unshare's mounts are private).
            setup = (
                f"mount --bind {hosts} /etc/hosts && mount --bind {self.ssh_dir} {home / '.ssh'} && "
                f"hostname {name} && echo ready && exec sleep infinity"
            )
            keeper = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "-m", "--uts", "sh", "-c", setup],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            self.daemons.append(keeper)
            if keeper.stdout.readline().strip() != "ready":
                raise RuntimeError(f"host {name} did not start: {keeper.stderr.read()}")
            self.hosts.append(Host(name, address, keeper))

    def _ssh(self) -> None:
        keys = self.dir / "ssh-keys"
        keys.mkdir()
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.ssh_dir / "id_ed25519"))
        (self.ssh_dir / "authorized_keys").write_text((self.ssh_dir / "id_ed25519.pub").read_text())
        known = []
        if not Path("/run/sshd").exists():  # sshd's privilege-separation directory (Debian's init makes it)
            Path("/run/sshd").mkdir(mode=0o755)
            self.made.append(Path("/run/sshd"))
        for host in self.hosts:
            key = keys / f"{host.name}_host_ed25519"
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
            known.append(f"{host.name},{host.address} {(key.with_suffix('.pub')).read_text().strip()}\n")
            config = keys / f"sshd_config_{host.name}"
            config.write_text(
                f"ListenAddress {host.address}\nHostKey {key}\nPidFile none\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                "X11Forwarding no\nPrintMotd no\nAuthorizedKeysFile .ssh/authorized_keys\n"
            )
            self.daemons.append(
                host.popen(
                    ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                    stdout=subprocess.DEVNULL,
                    stderr=open(self.dir / f"sshd-{host.name}.log", "w"),
                )
            )
        (self.ssh_dir / "known_hosts").write_text("".join(known))
        (self.ssh_dir / "config").write_text(
            "Host *\n  IdentityFile ~/.ssh/id_ed25519\n  UserKnownHostsFile ~/.ssh/known_hosts\n"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n"
        )
        for host in self.hosts:
            for other in self.hosts:
                _wait(
                    lambda: host.run(["ssh", other.name, "true"], timeout=20).returncode == 0,
                    f"ssh from {host.name} to {other.name} (see {self.dir}/sshd-*.log)",
                )

    # -- SLURM -----------------------------------------------------------------------------------

    def _slurm(self) -> None:
        state = self.dir / "slurm"
        (state / "state").mkdir(parents=True)
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        (munge / "munge.key").write_bytes(os.urandom(1024))
        (munge / "munge.key").chmod(0o400)
        socket = munge / "munge.socket"
        self.daemons.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={munge / 'munge.key'}",
                    f"--socket={socket}",
                    f"--pid-file={munge / 'munged.pid'}",
                    f"--log-file={munge / 'munged.log'}",
                    f"--seed-file={munge / 'munge.seed'}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait(socket.exists, "munged's socket")
        gpus = self.dir / "dev"
        gpus.mkdir()
        for index in range(2):  # SLURM's GRES only stats these: character devices, as /dev/nvidiaN are
            os.mknod(gpus / f"nvidia{index}", 0o600 | 0o020000, os.makedev(195, index))
        (state / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={gpus}/nvidia[0-1]\n")
        nodes = "".join(
            f"NodeName={h.name} NodeAddr={h.address} CPUs=2 RealMemory=1000 Gres=gpu:2 State=UNKNOWN\n"
            for h in self.hosts
        )
        self.slurm_conf.write_text(
            f"ClusterName=spds\nSlurmctldHost=h1({self.h1.address})\nSlurmUser=root\nSlurmdUser=root\n"
            f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={socket}\n"
            f"StateSaveLocation={state / 'state'}\nSlurmdSpoolDir={state}/spool-%n\n"
            f"SlurmctldPidFile={state}/slurmctld.pid\nSlurmdPidFile={state}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={state}/slurmctld.log\nSlurmdLogFile={state}/slurmd-%n.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core\nSchedulerType=sched/backfill\nMpiDefault=none\nSwitchType=switch/none\n"
            "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            "JobCompType=jobcomp/none\nReturnToService=2\nGresTypes=gpu\nMinJobAge=300\n"
            f"KillWait={self.kill_wait}\nPlugStackConfig={state}/plugstack.conf\n{nodes}"
            "PartitionName=main Nodes=h1,h2 Default=YES MaxTime=INFINITE State=UP\n"
        )
        (state / "plugstack.conf").write_text("")
        env = self.slurm_env(dict(os.environ))
        self.daemons.append(
            self.h1.popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        for host in self.hosts:
            self.daemons.append(
                host.popen(
                    ["slurmd", "-D", "-N", host.name], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )

        def idle() -> bool:
            out = self.h1.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env).stdout.split()
            return out.count("idle") == 2

        _wait(idle, f"both slurmd idle (see {state}/*.log)", timeout=60)

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        for process in reversed(self.daemons):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.daemons):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for process in self.daemons:
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        self._kill_leftovers()
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for path in reversed(self.made):
            try:
                path.rmdir()
            except OSError:
                pass
        self.daemons, self.namespaces, self.made = [], [], []

    def processes(self, pattern: str) -> list[str]:
        """'host: command line' of every process on a host whose command line holds pattern (the
        hosts share this machine's process table: a host's processes are those in its network
        namespace)."""
        import psutil

        hosts = {}
        for host, name in zip(self.hosts, self.namespaces):
            try:
                hosts[os.stat(f"/run/netns/{name}").st_ino] = host.name
            except OSError:
                pass
        found = []
        for process in psutil.process_iter(["cmdline"]):
            try:
                host = hosts.get(os.stat(f"/proc/{process.pid}/ns/net").st_ino)
                line = " ".join(process.info["cmdline"] or [])
            except (OSError, psutil.Error):
                continue
            if host and pattern in line and process.pid != os.getpid():
                found.append(f"{host}: {line}")
        return found

    def _kill_leftovers(self) -> None:
        """Processes still in a host's network namespace (ranks, slurmstepd) once the daemons are
        gone: a failed test must not leave them running."""
        import psutil

        inodes = set()
        for name in self.namespaces:
            try:
                inodes.add(os.stat(f"/run/netns/{name}").st_ino)
            except OSError:
                pass
        for process in psutil.process_iter():
            try:
                if os.stat(f"/proc/{process.pid}/ns/net").st_ino in inodes:
                    process.kill()
            except (OSError, psutil.Error):
                pass


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _wait(ready, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not ready():
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)
