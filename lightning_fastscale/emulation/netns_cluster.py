"""An emulated multi-node cluster on one Linux machine, built from network namespaces.

More in ``docs/emulated_cluster.md`` ("Network namespaces").
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "NamespaceUnavailable",
    "EmulatedNode",
    "NodeResult",
    "EmulatedCluster",
    "check_namespace_support",
    "remove_stale_namespaces",
]

# Namespace names are "fsc<pid>x<run>" + role: the pid makes parallel runs collide-free and
# lets a later run recognise (and remove) what a dead run left behind.
_NAME_PREFIX = "fsc"
_NAME_RE = re.compile(rf"^{_NAME_PREFIX}(\d+)x\d+")
_run_counter = itertools.count()
_IP_TIMEOUT_S = 20.0


class NamespaceUnavailable(RuntimeError):
    """Network namespaces cannot be built here; ``str(err)`` says why (for ``pytest.skip``)."""


@dataclass(frozen=True)
class EmulatedNode:
    """One emulated node: its namespace, its address on the emulated network and interface."""

    index: int
    namespace: str
    address: str
    interface: str = "eth0"


@dataclass
class NodeResult:
    """What one node's command did: exit code and captured output (``None`` when not captured)."""

    node: int
    returncode: int
    stdout: str | None
    stderr: str | None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=check
    )


def check_namespace_support() -> None:
    """Raise [`NamespaceUnavailable`][lightning_fastscale.emulation.NamespaceUnavailable] with the reason if namespaces cannot be made here.

    Checks root, the ``ip`` and ``tc`` tools, and actually creates (then deletes) a probe
    namespace, because containers may refuse ``CLONE_NEWNET`` even to root.
    """
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        raise NamespaceUnavailable("network namespaces need Linux")
    if os.geteuid() != 0:
        raise NamespaceUnavailable("network namespaces need root (run as root or skip)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NamespaceUnavailable(f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)")
    probe = f"{_NAME_PREFIX}{os.getpid()}x{next(_run_counter)}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise NamespaceUnavailable(f"`ip netns add` failed: {made.stderr.strip()}")
    try:
        veth = _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
        if veth.returncode != 0:
            raise NamespaceUnavailable(f"cannot create veth pairs: {veth.stderr.strip()}")
        tbf = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "a0", "root", "tbf",
             "rate", "100mbit", "burst", "64kb", "latency", "50ms"],
            capture_output=True, text=True, timeout=_IP_TIMEOUT_S,
        )
        if tbf.returncode != 0:
            raise NamespaceUnavailable(f"tbf qdisc unavailable: {tbf.stderr.strip()}")
    finally:
        _ip("netns", "del", probe, check=False)


def _die_with_parent() -> None:
    # If the harness itself is SIGKILLed its finally-blocks cannot run: let the kernel kill the
    # node launchers then (PR_SET_PDEATHSIG); a later run sweeps the namespaces.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> list[int]:
    """SIGKILL every process still inside ``namespace`` (all were started by this harness); the pids killed."""
    listed = _ip("netns", "pids", namespace, check=False)
    killed = []
    for pid in (int(p) for p in listed.stdout.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces that an earlier, killed run of this harness left behind.

    Only namespaces named by this harness whose creating process no longer exists are
    touched. Returns the names removed.
    """
    listed = _ip("netns", "list", check=False)
    removed = []
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class EmulatedCluster:
    """``num_nodes`` emulated nodes on a bridge, each link capped at ``bandwidth_mbit``.

    Use as a context manager; everything is torn down on exit::

        with EmulatedCluster(2, bandwidth_mbit=500) as cluster:
            results = cluster.run([["python", "work.py", str(i)] for i in range(2)], timeout=60)

    Args:
        num_nodes: number of nodes (namespaces), at least 1.
        bandwidth_mbit: cap of each node's link, per direction, in Mbit/s; ``None`` = uncapped.
        mtu: MTU of the inter-node links (9000: jumbo frames as in data-centre networks, and
            fewer packets for the shared CPUs to process).
        burst_kb: ``tbf`` bucket size; must hold at least one MTU and rate/HZ bytes.
        queue_latency_ms: ``tbf`` queue bound, as the longest time a packet may wait.
        subnet: first three octets of the private /24 used inside the namespaces only.
    """

    def __init__(
        self,
        num_nodes: int,
        bandwidth_mbit: float | None = None,
        *,
        mtu: int = 9000,
        burst_kb: int = 256,
        queue_latency_ms: int = 50,
        subnet: str = "10.213.7",
    ) -> None:
        if num_nodes < 1 or num_nodes > 250:
            raise ValueError(f"num_nodes must be in 1..250, got {num_nodes}")
        if bandwidth_mbit is not None and bandwidth_mbit <= 0:
            raise ValueError(f"bandwidth_mbit must be positive or None, got {bandwidth_mbit}")
        self.num_nodes = num_nodes
        self.bandwidth_mbit = bandwidth_mbit
        self.mtu = mtu
        self.burst_kb = burst_kb
        self.queue_latency_ms = queue_latency_ms
        self.subnet = subnet
        self.name = f"{_NAME_PREFIX}{os.getpid()}x{next(_run_counter)}"
        self.hub = f"{self.name}hub"
        self.nodes = [
            EmulatedNode(i, f"{self.name}n{i}", f"{subnet}.{i + 1}") for i in range(num_nodes)
        ]
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- building -------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        check_namespace_support()
        remove_stale_namespaces()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, device: str) -> None:
        if self.bandwidth_mbit is None:
            return
        subprocess.run(
            ["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf",
             "rate", f"{self.bandwidth_mbit}mbit", "burst", f"{self.burst_kb}kb",
             "latency", f"{self.queue_latency_ms}ms"],
            capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=True,
        )

    def _build(self) -> None:
        self._add_namespace(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "mtu", str(self.mtu))
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            self._add_namespace(node.namespace)
            port = f"p{node.index}"
            # Created inside the hub and moved straight into the node: never in the host's namespace.
            _ip("-n", self.hub, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", node.interface, "netns", node.namespace)
            _ip("-n", self.hub, "link", "set", port, "master", "br0")
            _ip("-n", self.hub, "link", "set", port, "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            self._shape(node.namespace, node.interface)  # node -> network
            self._shape(self.hub, port)  # network -> node
        self._wait_links_up()

    def _wait_links_up(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while True:
                state = _ip("-n", node.namespace, "-o", "link", "show", node.interface).stdout
                if "LOWER_UP" in state:
                    break
                if time.monotonic() > deadline:
                    raise NamespaceUnavailable(f"link of node {node.index} did not come up: {state}")
                time.sleep(0.05)

    # -- running --------------------------------------------------------------------
    def node_env(self, index: int) -> dict[str, str]:
        """Environment for processes of node ``index``: gloo/NCCL bound to the node's link."""
        node = self.nodes[index]
        return {
            "GLOO_SOCKET_IFNAME": node.interface,
            "NCCL_SOCKET_IFNAME": node.interface,
            "FASTSCALE_EMULATED_NODE": str(index),
        }

    def link_bytes(self, index: int) -> dict[str, int]:
        """Bytes node ``index`` has sent (``tx``) and received (``rx``) over its capped link."""
        shown = _ip("-n", self.nodes[index].namespace, "-s", "-j", "link", "show", self.nodes[index].interface)
        stats = json.loads(shown.stdout)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def start(
        self,
        index: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        capture: bool = True,
        cwd: str | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` inside node ``index`` (own session, so it can be killed as a group).

        The process is killed by the kernel if the calling thread dies, so call this from a
        thread that outlives it (``run`` does).
        """
        if self._closed:
            raise RuntimeError("cluster already closed")
        full_env = dict(os.environ if env is None else env)
        full_env.update(self.node_env(index))
        out = subprocess.PIPE if capture else None
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.nodes[index].namespace, *argv],
            env=full_env, stdout=out, stderr=out, text=True, start_new_session=True, cwd=cwd,
            preexec_fn=_die_with_parent,
        )
        with self._lock:
            self._procs.append(proc)
        return proc

    def kill_node(self, index: int) -> list[int]:
        """SIGKILL every process inside node ``index`` (a lost machine: no signal handler runs); the pids killed."""
        return _kill_namespace_processes(self.nodes[index].namespace)

    def run(
        self,
        commands: Sequence[Sequence[str]],
        timeout: float,
        env: Mapping[str, str] | None = None,
        capture: bool = True,
        cwd: str | None = None,
    ) -> list[NodeResult]:
        """Run ``commands[i]`` on node ``i`` concurrently; wait at most ``timeout`` seconds.

        When any node fails, the others are stopped (a distributed job cannot finish
        without all its nodes). On time-out every process is killed and ``TimeoutError``
        raised with what the nodes printed.
        """
        if len(commands) != self.num_nodes:
            raise ValueError(f"need one command per node ({self.num_nodes}), got {len(commands)}")
        procs = [self.start(i, cmd, env=env, capture=capture, cwd=cwd) for i, cmd in enumerate(commands)]
        outputs: dict[int, tuple[str | None, str | None]] = {}

        def drain(i: int, p: subprocess.Popen) -> None:
            outputs[i] = p.communicate()

        threads = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(procs)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # grace period so the others can report their side of the failure
                self._stop(procs)
                break
            if time.monotonic() > deadline:
                timed_out = True
                self._stop(procs)
                break
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=10)
        results = [
            NodeResult(i, p.returncode if p.returncode is not None else -9, *outputs.get(i, (None, None)))
            for i, p in enumerate(procs)
        ]
        if timed_out:
            tails = "\n".join(f"--- node {r.node} ---\n{(r.stdout or '')[-2000:]}{(r.stderr or '')[-2000:]}" for r in results)
            raise TimeoutError(f"emulated-cluster run exceeded {timeout}s\n{tails}")
        return results

    def _stop(self, procs: Sequence[subprocess.Popen]) -> None:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0  # grace before SIGKILL
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process started in the cluster and delete every namespace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop(self._procs)
        finally:
            for name in reversed(self._namespaces):
                # Workers may have left their launcher's process group: sweep the namespace too.
                _kill_namespace_processes(name)
                _ip("netns", "del", name, check=False)
            self._namespaces.clear()
