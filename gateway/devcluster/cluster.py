"""The one-host development cluster: munge, MariaDB, slurmdbd, slurmctld, two slurmd.

``up`` installs what is missing (apt), renders configs from slurm_templates/,
creates fake GPU device files, starts every daemon it needs (recording PIDs),
applies the QOS policy, makes the gateway's service user a Slurm Operator (the
configs set PrivateData) and waits until both nodes are idle. It is idempotent.
``down`` stops only the PIDs ``up`` recorded; a MariaDB that was already running
is reused and left alone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template

from gateway.errors import SlurmError
from gateway.slurm.admin import Admin
from gateway.slurm.policy import load_policy
from gateway.slurm.runner import LocalRunner, SlurmCommandError
from gateway.storage import layout, quota

MARKER = "# slurm-finetune dev cluster"
APT_PACKAGES = ("slurm-wlm", "slurmctld", "slurmd", "slurmdbd", "slurm-client", "munge",
                "mariadb-server", "libpmix-dev", "python3-venv", "btrfs-progs")
NEEDED_BINARIES = ("sbatch", "slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sacctmgr", "mkfs.btrfs")


class DevClusterError(SlurmError):
    """The dev cluster could not be brought up or down; the message says which step."""


@dataclass(frozen=True)
class DevClusterConfig:
    host: str
    cluster: str = "sftdev"
    nodes: int = 2
    gpus_per_node: int = 4
    cpus_per_node: int = 16
    mem_mb_per_node: int = 32000
    ctld_port: int = 6817
    dbd_port: int = 6819
    node_port_base: int = 17001
    conf_dir: Path = Path("/etc/slurm")
    state_dir: Path = Path("/var/lib/slurm-finetune/devcluster")
    log_dir: Path = Path("/var/log/slurm-finetune")
    run_dir: Path = Path("/run/slurm-finetune")
    runtime_prefix: Path = Path("/opt/slurm-finetune")
    scratch_root: Path = Path("/var/lib/slurm-finetune/scratch")
    report_dir: Path = Path("/var/lib/slurm-finetune/scrub")
    job_tmp_root: Path = Path("/var/lib/slurm-finetune/jobtmp")  # job_container/tmpfs BasePath
    storage_root: Path = Path("/srv/slurm-finetune")
    tenant_storage_gb: int = 48           # the sparse btrfs image behind <storage_root>/tenants (quotas)
    db_name: str = "slurm_acct_db"
    db_user: str = "slurm"
    service_user: str = "sft-gateway"     # the gateway's unix user: made a Slurm Operator
    node_names: tuple[str, ...] = field(default=())
    # A simulated cluster beside the two real nodes, for capacity runs (bench/capacity.py): this many more
    # slurmd on this host, each with ``sim_gpus_per_node`` fake GPUs (device files as the real nodes'), in a
    # partition of their own (never the default one), with the same prolog, epilog, QOS and fairshare.
    # Only a gateway whose ``simulate_trainer_speedup`` is set should send jobs there (nothing trains).
    sim_nodes: int = 0
    sim_gpus_per_node: int = 8
    sim_partition: str = "sim"

    def names(self) -> tuple[str, ...]:
        """The slurmd node names: ``node_names`` when set, else ``<host>-n1`` ... ``<host>-n<nodes>``."""
        return self.node_names or tuple(f"{self.host}-n{i + 1}" for i in range(self.nodes))

    def sim_names(self) -> tuple[str, ...]:
        """The simulated nodes' names: ``<host>-s1`` ... ``<host>-s<sim_nodes>``."""
        return tuple(f"{self.host}-s{i + 1}" for i in range(self.sim_nodes))

    def all_names(self) -> tuple[str, ...]:
        """Every slurmd this host runs: the real nodes, then the simulated ones."""
        return self.names() + self.sim_names()

    @property
    def pid_file(self) -> Path:
        """Where ``up`` records the PIDs of the daemons it started (``down`` stops only those)."""
        return self.state_dir / "pids.json"

    @property
    def libexec(self) -> Path:
        """Where the prolog, epilog and task prolog wrappers go (slurm.conf names them there)."""
        return self.runtime_prefix / "libexec"


def _proc_mount_options() -> str:
    """The mount options of /proc ("" when /proc/mounts does not say)."""
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] == "/proc":
            return parts[3]
    return ""


def short_hostname() -> str:
    """This host's name up to the first dot."""
    return socket.gethostname().split(".")[0]


# ------------------------------------------------------------------ rendering
def _template(name: str) -> Template:
    return Template(resources.files("slurm_templates").joinpath(name).read_text())


def render_configs(cfg: DevClusterConfig, db_pass: str) -> dict[str, str]:
    """Config file name → text. Pure: same config, same text."""
    names = cfg.names()
    g = cfg.gpus_per_node
    node_lines = "\n".join(
        f"NodeName={n} NodeHostname={cfg.host} NodeAddr=127.0.0.1 "
        f"Port={cfg.node_port_base + i} CPUs={cfg.cpus_per_node} "
        f"RealMemory={cfg.mem_mb_per_node} Gres=gpu:{g} State=UNKNOWN"
        for i, n in enumerate(names))
    gres_lines = "\n".join(
        f"NodeName={n} Name=gpu File=/dev/nvidia[{i * g}-{i * g + g - 1}]"
        for i, n in enumerate(names))
    sims = cfg.sim_names()
    sg = cfg.sim_gpus_per_node
    if sims:     # memory for sg ranks of the gateway's default job_mem_mb (8 GiB), claimed, not checked
        node_lines += "\n" + "\n".join(
            f"NodeName={n} NodeHostname={cfg.host} NodeAddr=127.0.0.1 "
            f"Port={cfg.node_port_base + len(names) + i} CPUs={2 * sg} "
            f"RealMemory={sg * 8192 + 1024} Gres=gpu:{sg} State=UNKNOWN"
            for i, n in enumerate(sims))
        base = len(names) * g            # fake device files after the real nodes' (Slurm counts no GPU without one)
        gres_lines += "\n" + "\n".join(
            f"NodeName={n} Name=gpu File=/dev/nvidia[{base + i * sg}-{base + i * sg + sg - 1}]"
            for i, n in enumerate(sims))
    sim_partition = (f"PartitionName={cfg.sim_partition} Nodes={','.join(sims)} Default=NO "
                     f"MaxTime=INFINITE State=UP\n") if sims else ""
    job_container_lines = "\n".join(f"NodeName={n} BasePath={cfg.job_tmp_root / n}" for n in names + sims)
    common = {
        "job_container_lines": job_container_lines,
        "cluster": cfg.cluster, "host": cfg.host, "ctld_port": cfg.ctld_port,
        "dbd_port": cfg.dbd_port, "state_dir": cfg.state_dir, "run_dir": cfg.run_dir,
        "log_dir": cfg.log_dir, "prolog": cfg.libexec / "prolog.sh",
        "epilog": cfg.libexec / "epilog.sh", "task_prolog": cfg.libexec / "task_prolog.sh",
        "nodes": node_lines,
        "node_list": ",".join(names), "gres_lines": gres_lines, "sim_partition": sim_partition,
        "db_user": cfg.db_user, "db_pass": db_pass, "db_name": cfg.db_name,
    }
    return {
        "slurm.conf": _template("slurm.conf.tmpl").substitute(common),
        "gres.conf": _template("gres.conf.tmpl").substitute(common),
        "cgroup.conf": _template("cgroup.conf.tmpl").substitute(common),
        "slurmdbd.conf": _template("slurmdbd.conf.tmpl").substitute(common),
        "job_container.conf": _template("job_container.conf.tmpl").substitute(common),
    }


def render_wrappers(cfg: DevClusterConfig) -> dict[str, str]:
    """Wrapper file name → text (pure): prolog/epilog exec the scrubber from the runtime venv."""
    values = {"scratch_root": cfg.scratch_root, "log_dir": cfg.log_dir,
              "runtime_prefix": cfg.runtime_prefix, "report_dir": cfg.report_dir}
    return {n: _template(n).substitute(values) for n in ("prolog.sh", "epilog.sh", "task_prolog.sh")}


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


# ------------------------------------------------------------------- the cluster
class DevCluster:
    """Bring-up, tear-down and status of the one-host cluster (root only)."""

    def __init__(self, cfg: DevClusterConfig | None = None, *,
                 echo: Callable[[str], None] = print):
        self.cfg = cfg or DevClusterConfig(host=short_hostname())
        self.runner = LocalRunner()
        self.echo = echo

    # -- helpers
    def _pids(self) -> dict[str, int]:
        try:
            return json.loads(self.cfg.pid_file.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def _save_pids(self, pids: dict[str, int]) -> None:
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        _write(self.cfg.pid_file, json.dumps(pids, indent=1), 0o600)

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie is not alive
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except (OSError, IndexError):
            return False

    def _wait(self, what: str, ok: Callable[[], bool], timeout: float, step: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(step)
        raise DevClusterError(f"{what} not ready after {timeout:.0f}s; see {self.cfg.log_dir}")

    def _spawn(self, key: str, argv: list[str], pids: dict[str, int]) -> None:
        pid = pids.get(key)
        if pid and self._alive(pid):
            return
        log = open(self.cfg.log_dir / f"{key}.console.log", "ab")  # noqa: SIM115
        # cwd "/": a daemon must not keep the caller's directory (a checkout, a temp dir) busy,
        # nor lose it: the prolog's `python -m` dies when its inherited cwd has been removed.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,  # noqa: S603
                                stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
        log.close()
        pids[key] = proc.pid
        self._save_pids(pids)

    def _ok(self, argv: list[str]) -> bool:
        try:
            return self.runner.run(argv, timeout=10).returncode == 0
        except SlurmCommandError:
            return False

    # -- up
    def up(self) -> float:
        """Bring the cluster up; return the seconds it took. Raises DevClusterError."""
        if os.geteuid() != 0:
            raise DevClusterError("dev-cluster needs root (it starts daemons and adds users)")
        t0 = time.monotonic()
        self.ensure_packages()
        for line in self.harden_host():
            self.echo(line)
        self.echo(self.tenant_storage())
        for d in (self.cfg.state_dir / "slurmctld", self.cfg.state_dir / "slurmd", self.cfg.log_dir, self.cfg.run_dir,
                  self.cfg.libexec, self.cfg.scratch_root):
            d.mkdir(parents=True, exist_ok=True)
        db_pass = self._db_password()
        if self.write_configs(db_pass) and any(self._alive(p) for k, p in self._pids().items()
                                               if k.startswith("slurm")):
            self.echo("Slurm configuration changed: restarting the Slurm daemons")
            self._stop([k for k in self._pids() if k.startswith("slurm")])
        self.make_fake_gpus()
        pids = self._pids()
        self.start_munge(pids)
        self.start_mariadb(pids, db_pass)
        self._spawn("slurmdbd", ["slurmdbd", "-D"], pids)
        self._wait("slurmdbd", lambda: self._port_open(self.cfg.dbd_port), 30)
        self._ensure_cluster_registered()
        self._spawn("slurmctld", ["slurmctld", "-D"], pids)
        self._wait("slurmctld", lambda: self._ok(["scontrol", "ping"]), 30)
        for n in self.cfg.all_names():
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n], pids)
        self._stop([k for k in self._pids() if k.startswith("slurmd-") and k[7:] not in self.cfg.all_names()])
        self._wait("nodes", self._nodes_usable, 60 + 2 * len(self.cfg.sim_names()))
        admin = Admin(self.runner)
        admin.apply_qos(load_policy())
        # PrivateData hides other users' jobs and usage: the gateway must still see and act on all of them.
        if admin.ensure_operator(self.cfg.service_user):
            self.echo(f"{self.cfg.service_user} is now a Slurm Operator (sees and manages every tenant's jobs)")
        return time.monotonic() - t0

    def harden_host(self) -> list[str]:
        """What SECURITY.md asks of gateway, login and compute hosts, applied to this one (it is all of
        them): ``kernel.yama.ptrace_scope`` >= 1 (a tenant may not ptrace even its own sbatch, which the
        broker runs as it) and ``/proc`` with ``hidepid=invisible`` (no tenant sees another's processes
        or their command lines). Returns one line per measure: applied, already so, or why not."""
        out = []
        scope = Path("/proc/sys/kernel/yama/ptrace_scope")
        if not scope.exists():
            out.append("host hardening: this kernel has no Yama LSM, so ptrace of one's own processes stays "
                       "allowed (the gateway confirms every id sbatch prints; see SECURITY.md)")
        elif int(scope.read_text().strip() or 0) < 1:
            scope.write_text("1\n")
            out.append("host hardening: kernel.yama.ptrace_scope=1")
        if "hidepid=" not in _proc_mount_options():
            res = self.runner.run(["mount", "-o", "remount,hidepid=invisible", "/proc"], timeout=30)
            out.append("host hardening: /proc remounted hidepid=invisible" if res.returncode == 0 else
                       f"host hardening: could not remount /proc with hidepid ({res.stderr.strip()[:200]})")
        return out

    def tenant_storage(self) -> str:
        """Put ``<storage_root>/tenants`` on a filesystem with quotas, as a site's shared filesystem would
        be: a sparse btrfs image (``tenant_storage_gb``) loop-mounted there with quotas on, so each new
        tenant root is a subvolume whose space ``finetune admin tenant quota`` limits in the kernel.
        Tenant roots already there are moved into subvolumes of their own. Returns one line: what it did,
        or why the tenants directory stays as it is (no btrfs in this kernel: quotas are then off)."""
        tenants = layout.tenants_dir(self.cfg.storage_root)
        tenants.mkdir(parents=True, exist_ok=True)
        if self._quota_on(tenants):
            return f"tenant storage: {tenants} is btrfs with quotas on"
        image = self.cfg.state_dir / "tenant-storage.btrfs"
        image.parent.mkdir(parents=True, exist_ok=True)
        if not image.exists():
            with open(image, "wb") as f:
                f.truncate(self.cfg.tenant_storage_gb << 30)
            os.chmod(image, 0o600)
            made = self.runner.run(["mkfs.btrfs", "-q", str(image)], timeout=120)
            if made.returncode != 0:
                image.unlink()
                return f"tenant storage: no quotas (mkfs.btrfs failed: {made.stderr.strip()[:200]})"
        old = [p for p in tenants.iterdir()] if tenants.is_dir() else []
        target = self.cfg.state_dir / "tenant-storage.mnt" if old else tenants
        target.mkdir(exist_ok=True)
        mounted = self.runner.run(["mount", "-o", "loop,noatime", str(image), str(target)], timeout=60)
        if mounted.returncode != 0:
            return f"tenant storage: no quotas ({tenants} stays as it is: {mounted.stderr.strip()[:200]})"
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if not quota.enabled(fd):
                quota.enable(fd)
            for entry in old:         # each tenant root becomes a subvolume holding the same files
                if entry.is_dir() and not entry.is_symlink():
                    quota.create_subvolume(fd, entry.name)
                    self.runner.run(["cp", "-a", f"{entry}/.", str(target / entry.name)], timeout=1800).check()
                    st = entry.lstat()
                    os.chown(target / entry.name, st.st_uid, st.st_gid)
                    os.chmod(target / entry.name, stat.S_IMODE(st.st_mode))
        finally:
            os.close(fd)
        if old:
            self.runner.run(["umount", str(target)], timeout=60).check()
            aside = tenants.with_name("tenants.pre-btrfs")
            tenants.rename(aside)
            tenants.mkdir()
            self.runner.run(["mount", "-o", "loop,noatime", str(image), str(tenants)], timeout=60).check()
            shutil.rmtree(aside)
        os.chown(tenants, 0, 0)
        os.chmod(tenants, 0o711)
        return (f"tenant storage: {tenants} is now a btrfs image ({image}, {self.cfg.tenant_storage_gb} GiB sparse) "
                f"with quotas on" + (f"; {len(old)} tenant roots moved into subvolumes" if old else ""))

    @staticmethod
    def _quota_on(path: Path) -> bool:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return quota.enabled(fd)
        finally:
            os.close(fd)

    def ensure_packages(self) -> None:
        """apt-get install the Slurm, munge and MariaDB packages when one of NEEDED_BINARIES is missing."""
        missing = [b for b in NEEDED_BINARIES
                   if not shutil.which(b, path="/usr/sbin:/usr/bin:/sbin:/bin")]
        if not missing:
            return
        self.echo(f"installing Slurm packages (missing: {', '.join(missing)}) ...")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        self.runner.run(["apt-get", "update", "-q"], timeout=600, env=env).check()
        self.runner.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                         *APT_PACKAGES], timeout=1200, env=env).check()

    def _db_password(self) -> str:
        path = self.cfg.state_dir / "db.secret"
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            _write(path, secrets.token_hex(16), 0o600)
        return path.read_text().strip()

    def write_configs(self, db_pass: str) -> bool:
        """Write configs and wrappers; return whether a Slurm config file changed."""
        self.cfg.conf_dir.mkdir(parents=True, exist_ok=True)
        changed = False
        for name, text in render_configs(self.cfg, db_pass).items():
            path = self.cfg.conf_dir / name
            old = path.read_text() if path.exists() else None
            if old is not None and not old.startswith(MARKER):
                raise DevClusterError(f"{path} exists and was not written by slurm-finetune: "
                                      "refusing to overwrite a real cluster's configuration")
            if old != text:
                _write(path, text, 0o600 if name == "slurmdbd.conf" else 0o644)
                changed = True
        for name, text in render_wrappers(self.cfg).items():
            _write(self.cfg.libexec / name, text, 0o755)
        return changed

    def make_fake_gpus(self) -> None:
        """Create /dev/nvidia0..N-1 (char devices 195:i, mode 0666) for the nodes' fake GPUs (the
        simulated nodes' included: Slurm 22.05 counts no GPU that gres.conf gives no file)."""
        for i in range(self.cfg.nodes * self.cfg.gpus_per_node + self.cfg.sim_nodes * self.cfg.sim_gpus_per_node):
            dev = Path(f"/dev/nvidia{i}")
            if not dev.exists():
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(195, i))
            os.chmod(dev, 0o666)

    def start_munge(self, pids: dict[str, int]) -> None:
        """Start munged with a fresh key (when none exists), unless munge already answers."""
        if self._ok(["munge", "-n"]):
            return
        run = Path("/run/munge")
        run.mkdir(exist_ok=True)
        shutil.chown(run, "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            _write(key, secrets.token_hex(512), 0o400)
            shutil.chown(key, "munge", "munge")
        self._spawn("munged", ["runuser", "-u", "munge", "--", "/usr/sbin/munged",
                               "--foreground"], pids)
        self._wait("munged", lambda: self._ok(["munge", "-n"]), 15)

    def start_mariadb(self, pids: dict[str, int], db_pass: str) -> None:
        """Start MariaDB unless one answers (then it is reused), and give ``db_user`` ``db_pass`` and all
        rights on ``db_name``."""
        ping = ["mariadb-admin", "--protocol=socket", "ping"]
        if not self._ok(ping):
            if not Path("/var/lib/mysql/mysql").exists():
                self.runner.run(["mariadb-install-db", "--user=mysql",
                                 "--datadir=/var/lib/mysql"], timeout=120).check()
            run = Path("/run/mysqld")
            run.mkdir(exist_ok=True)
            shutil.chown(run, "mysql", "mysql")
            self._spawn("mariadbd", ["/usr/sbin/mariadbd", "--user=mysql",
                                     "--innodb-buffer-pool-size=1024M",
                                     "--innodb-lock-wait-timeout=900"], pids)
            self._wait("mariadb", lambda: self._ok(ping), 60)
        u, d = self.cfg.db_user, self.cfg.db_name
        sql = (f"CREATE USER IF NOT EXISTS '{u}'@'localhost' IDENTIFIED BY '{db_pass}';"
               f"ALTER USER '{u}'@'localhost' IDENTIFIED BY '{db_pass}';"
               f"GRANT ALL ON {d}.* TO '{u}'@'localhost';")
        self.runner.run(["mariadb", "--protocol=socket", "-e", sql], timeout=30).check()

    def _ensure_cluster_registered(self) -> None:
        out = self.runner.run(["sacctmgr", "-n", "-P", "show", "cluster", "format=Cluster"],
                              timeout=30).check().stdout.split()
        if self.cfg.cluster not in out:
            self.runner.run(["sacctmgr", "-i", "add", "cluster", self.cfg.cluster],
                            timeout=30).check()

    @staticmethod
    def _port_open(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def node_states(self) -> dict[str, str]:
        """Node name → sinfo state (``idle``, ``down*``, ...); {} when sinfo fails."""
        res = self.runner.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=10)
        if res.returncode != 0:
            return {}
        return dict(line.split() for line in res.stdout.splitlines() if line.strip())

    def _nodes_usable(self) -> bool:
        states = self.node_states()
        names = self.cfg.all_names()
        if set(states) != set(names):
            return False
        stuck = [n for n, s in states.items() if s.rstrip("*") in ("down", "drained", "draining",
                                                                   "drain", "inval")]
        if stuck:  # left over from an earlier run: a fresh bring-up resumes them
            self.runner.run(["scontrol", "update", "nodename=" + ",".join(stuck),
                             "state=resume"], timeout=10)
            return False
        return all(s.rstrip("*") in ("idle", "mixed", "allocated", "completing")
                   for s in states.values())

    # -- down / status
    def down(self, timeout: float = 20.0) -> list[str]:
        """Stop the daemons ``up`` started (only those PIDs); return their names."""
        pids = self._pids()
        order = [k for k in pids if k.startswith("slurmd-")] + \
                [k for k in ("slurmctld", "slurmdbd", "mariadbd", "munged") if k in pids]
        return self._stop(order, timeout)

    def _stop(self, order: list[str], timeout: float = 20.0) -> list[str]:
        pids = self._pids()
        stopped = []
        for key in order:
            pid = pids[key]
            if self._alive(pid):
                try:
                    os.killpg(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                stopped.append(key)
        deadline = time.monotonic() + timeout
        for key in order:
            while self._alive(pids[key]) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._alive(pids[key]):
                os.killpg(pids[key], signal.SIGKILL)
        self._save_pids({k: p for k, p in pids.items() if k not in order})
        return stopped

    def status(self) -> dict[str, object]:
        """The recorded daemons (pid, alive) and, when any was recorded, the nodes' states."""
        pids = self._pids()
        return {
            "daemons": {k: {"pid": p, "alive": self._alive(p)} for k, p in pids.items()},
            "nodes": self.node_states() if pids else {},
        }
