"""What a real node changes on this machine outside its state folder, recorded before it starts
and undone after it stops: sysctls, iptables chains and the rules that jump to them, the bridge,
cgroups, mounts, network namespaces, and the folders the kubelet and containerd hard-code
(/var/lib/kubelet, /run/containerd, /var/lib/cni, /var/run/netns).

    before = HostRecord.take(cgroup_root, bridge)      # saved with the node's state (JSON)
    ...                                                # the node runs
    leftovers(before)  -> what is still there          # [] after undo(before)
    undo(before)

Nothing here sends a packet: it reads and writes tables, files and links of this machine.
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field

# The sysctls the kubelet (setupKernelTunables), kube-proxy and the bridge's forwarding change.
SYSCTLS = ("net/ipv4/ip_forward", "net/ipv4/conf/all/route_localnet",
           "net/bridge/bridge-nf-call-iptables", "net/bridge/bridge-nf-call-ip6tables",
           "kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory", "vm/panic_on_oom",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
# Folders the kubelet and containerd use whatever their configured roots say.
HARD_CODED = ("/var/lib/kubelet", "/run/containerd", "/var/lib/cni", "/var/run/netns",
              "/run/netns")
# Chains the kubelet, kube-proxy, CNI plugins and the node's egress guard make.
CHAIN_PREFIXES = ("KUBE-", "CNI-", "ARCHWAY-")
TABLES = ("filter", "nat", "mangle", "raw")
CGROUP_BASE = "/sys/fs/cgroup"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60)


def read_sysctl(name: str) -> str | None:
    try:
        with open(f"/proc/sys/{name}") as f:
            return f.read().strip()
    except OSError:
        return None


def write_sysctl(name: str, value: str) -> None:
    try:
        with open(f"/proc/sys/{name}", "w") as f:
            f.write(value)
    except OSError:
        pass


def iptables_tools() -> list[str]:
    return [tool for tool in ("iptables", "ip6tables") if shutil.which(tool)]


def chains(tool: str, table: str) -> list[str]:
    done = _run(tool, "-w", "5", "-t", table, "-S")
    return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("-N ")]


def rules(tool: str, table: str) -> list[str]:
    done = _run(tool, "-w", "5", "-t", table, "-S")
    return [line for line in done.stdout.splitlines() if line.startswith("-A ")]


def cgroup_dirs(cgroup_root: str) -> list[str]:
    """The node's cgroup folder in every hierarchy mounted under /sys/fs/cgroup."""
    try:
        hierarchies = sorted(os.listdir(CGROUP_BASE))
    except OSError:
        return []
    return [os.path.join(CGROUP_BASE, h, cgroup_root.strip("/")) for h in hierarchies
            if os.path.isdir(os.path.join(CGROUP_BASE, h))]


def mounts_under(prefixes: list[str]) -> list[str]:
    """Mount points under any of `prefixes`, deepest first."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].replace("\\040", " ")
            if any(target == p or target.startswith(p.rstrip("/") + "/") for p in prefixes):
                found.append(target)
    return sorted(set(found), key=lambda t: (-t.count("/"), t))


@dataclass
class HostRecord:
    """This machine as it was before the node started."""
    cgroup_root: str
    bridge: str
    state_dir: str
    # Folders of the node's own outside state_dir (short paths: a unix socket's path has at
    # most 104 bytes): removed whole; what mounts under them or names them is the node's.
    owned: list[str] = field(default_factory=list)
    sysctls: dict[str, str | None] = field(default_factory=dict)
    existing_dirs: list[str] = field(default_factory=list)
    existing_chains: dict[str, list[str]] = field(default_factory=dict)   # "tool table" -> names
    existing_netns: list[str] = field(default_factory=list)

    @classmethod
    def take(cls, cgroup_root: str, bridge: str, state_dir: str,
             owned: list[str] | None = None) -> "HostRecord":
        record = cls(cgroup_root, bridge, state_dir, list(owned or []))
        record.sysctls = {name: read_sysctl(name) for name in SYSCTLS}
        record.existing_dirs = [d for d in HARD_CODED if os.path.lexists(d)]
        record.existing_chains = {f"{tool} {table}": chains(tool, table)
                                  for tool in iptables_tools() for table in TABLES}
        record.existing_netns = _netns_files()
        return record

    def as_dict(self) -> dict:
        return asdict(self)

    def ours(self, tool: str, table: str, chain: str) -> bool:
        return (chain.startswith(CHAIN_PREFIXES)
                and chain not in self.existing_chains.get(f"{tool} {table}", []))


def _netns_files() -> list[str]:
    out = []
    for folder in ("/var/run/netns", "/run/netns"):
        if os.path.isdir(folder):
            out += [os.path.join(folder, n) for n in os.listdir(folder)]
    return sorted(set(os.path.realpath(p) for p in out))


# --- what is left --------------------------------------------------------------------------------

def leftovers(record: HostRecord) -> list[str]:
    """Everything the node made that is still on this machine (empty after `undo`)."""
    found = leftover_firewall(record)
    if os.path.exists(f"/sys/class/net/{record.bridge}"):
        found.append(f"bridge {record.bridge}")
    found += [f"cgroup {d}" for d in cgroup_dirs(record.cgroup_root) if os.path.isdir(d)]
    found += [f"mount {m}" for m in mounts_under([record.state_dir, *record.owned, *HARD_CODED])]
    found += [f"netns {n}" for n in _netns_files() if n not in record.existing_netns]
    found += [f"folder {d}" for d in HARD_CODED
              if os.path.lexists(d) and d not in record.existing_dirs]
    found += [f"folder {d}" for d in record.owned if os.path.lexists(d)]
    found += [f"process {pid} ({name})" for pid, name in processes_of(record)]
    found += [f"sysctl {name}={read_sysctl(name)} (was {value})"
              for name, value in record.sysctls.items()
              if value is not None and read_sysctl(name) != value]
    return found


def leftover_firewall(record: HostRecord) -> list[str]:
    """The iptables chains the node made, and the rules that jump to them, still there."""
    found = []
    for tool in iptables_tools():
        for table in TABLES:
            found += [f"{tool} -t {table} chain {c}" for c in chains(tool, table)
                      if record.ours(tool, table, c)]
            found += [f"{tool} -t {table} rule {r}" for r in rules(tool, table)
                      if jumps_to_ours(record, tool, table, r)]
    return found


def jumps_to_ours(record: HostRecord, tool: str, table: str, rule: str) -> bool:
    words = shlex.split(rule)
    chain = words[1]
    for flag in ("-j", "-g"):
        if flag in words:
            target = words[words.index(flag) + 1]
            if record.ours(tool, table, target) and not record.ours(tool, table, chain):
                return True
    return False


def processes_of(record: HostRecord) -> list[tuple[int, str]]:
    """Processes in the node's cgroups, and containerd shims of its containerd."""
    pids: set[int] = set()
    for folder in cgroup_dirs(record.cgroup_root):
        for root, _, files in os.walk(folder):
            if "cgroup.procs" in files:
                try:
                    with open(os.path.join(root, "cgroup.procs")) as f:
                        pids.update(int(p) for p in f.read().split())
                except OSError:
                    pass
    markers = [m.encode() for m in (record.state_dir, *record.owned)]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    line = f.read()
                if any(m in line for m in markers):
                    pids.add(int(entry))
            except OSError:
                pass
    pids -= _ancestors()
    out = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/comm") as f:
                out.append((pid, f.read().strip()))
        except OSError:
            pass
    return out


def _ancestors() -> set[int]:
    """This process and its parents (a `down` whose command line names the folder)."""
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().split(b") ", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


# --- undo ----------------------------------------------------------------------------------------

def undo(record: HostRecord) -> None:
    """Put this machine back as `record` found it (every step tolerates a partial start)."""
    _kill_processes(record)
    for target in mounts_under([record.state_dir, *record.owned, *HARD_CODED]):
        _run("umount", "-l", target)
    for netns in _netns_files():
        if netns not in record.existing_netns:
            _run("umount", "-l", netns)
            _remove(netns)
    _remove_iptables(record)
    if os.path.exists(f"/sys/class/net/{record.bridge}"):
        _run("ip", "link", "delete", record.bridge)
    _remove_cgroups(record.cgroup_root)
    for folder in HARD_CODED:
        made_here = os.path.lexists(folder) and folder not in record.existing_dirs
        if made_here and not mounts_under([folder]):
            if os.path.islink(folder):    # /var/run -> /run: /var/run/netns is /run/netns
                os.unlink(folder)
            else:
                shutil.rmtree(folder, ignore_errors=True)
    for folder in record.owned:
        shutil.rmtree(folder, ignore_errors=True)
    for name, value in record.sysctls.items():
        if value is not None and read_sysctl(name) != value:
            write_sysctl(name, value)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _kill_processes(record: HostRecord, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = processes_of(record)
        if not found:
            return
        for pid, _ in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _remove_iptables(record: HostRecord) -> None:
    for tool in iptables_tools():
        for table in TABLES:
            for rule in rules(tool, table):
                if jumps_to_ours(record, tool, table, rule):
                    # `-S` quotes comments: split as the shell would.
                    _run(tool, "-w", "5", "-t", table, "-D", *shlex.split(rule)[1:])
            ours = [c for c in chains(tool, table) if record.ours(tool, table, c)]
            for chain in ours:
                _run(tool, "-w", "5", "-t", table, "-F", chain)
            for chain in ours:
                _run(tool, "-w", "5", "-t", table, "-X", chain)


def _remove_cgroups(cgroup_root: str, timeout: float = 10.0) -> None:
    """rmdir the node's cgroup trees, deepest first (a cgroup goes once its tasks have exited)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        remaining = [d for d in cgroup_dirs(cgroup_root) if os.path.isdir(d)]
        if not remaining:
            return
        for top in remaining:
            folders = [root for root, _, _ in os.walk(top)]
            for folder in sorted(folders, key=lambda f: -f.count("/")):
                try:
                    os.rmdir(folder)
                except OSError:
                    pass
        time.sleep(0.2)


# The guard's table: mangle's FORWARD sees every forwarded packet before filter's, where
# kube-proxy puts its own jumps (some ACCEPT) ahead of anything there before it.
GUARD_TABLE = "mangle"


def guard_rules(chain: str, bridge: str, cidrs: list[str]) -> list[list[str]]:
    """The egress guard: packets from the pods or the Service range that would leave through any
    interface but the cluster's bridge are dropped (pure: the iptables arguments)."""
    out = [["-t", GUARD_TABLE, "-N", chain]]
    out += [["-t", GUARD_TABLE, "-A", chain, "-s", cidr, "!", "-o", bridge, "-j", "DROP"]
            for cidr in cidrs]
    out.append(["-t", GUARD_TABLE, "-I", "FORWARD", "1", "-j", chain])
    return out


def guard_in_place(chain: str, bridge: str, cidrs: list[str]) -> bool:
    """Does FORWARD (mangle, the first table a forwarded packet meets) jump to `chain`, which
    drops each CIDR's packets not for `bridge`, before any rule but another node's guard (the
    real node's and the VM nodes' guards only drop, so their order does not matter)?"""
    forward = rules("iptables", GUARD_TABLE)
    forward_rules = [r for r in forward if r.split()[1] == "FORWARD"]
    ahead = forward_rules[:forward_rules.index(f"-A FORWARD -j {chain}")] if (
        f"-A FORWARD -j {chain}" in forward_rules) else None
    if ahead is None or not all(re.fullmatch(r"-A FORWARD -j ARCHWAY-[A-Z-]+-EGRESS", r) for r in ahead):
        return False
    ours = [r for r in forward if r.split()[1] == chain]
    wanted = {re.sub(r"/32\b", "", f"-A {chain} -s {c} ! -o {bridge} -j DROP") for c in cidrs}
    return wanted <= {re.sub(r"/32\b", "", r) for r in ours}
