"""Separate "nodes" on one machine: network namespaces with their own addresses, made and
removed by the test (root only).

Each node has two links, as a testbed node has a cluster network and a route to storage:
* the node network: one bridge in the root namespace, each node's `node0` on it at
  10.213.0.(2 + n). Node to node traffic (rendezvous, gloo) goes there and nowhere else;
* the storage link: a veth pair of its own to the root namespace. There a forwarder to the
  local Swift listens on the root end's address, `storage_host(n)`.

`cut_storage(n)` takes node n's storage link down at the root end, as a pulled cable: its
packets go nowhere and its connections see no reset, until `restore_storage(n)`.

Names carry the test process's pid: a second run at the same time makes its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["NODE_IFNAME", "Nodes", "netns_missing"]

NODE_IFNAME = "node0"  # the node network's interface, inside each namespace (GLOO_SOCKET_IFNAME)


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def netns_missing() -> str | None:
    """Why this machine cannot make network namespaces, or None."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    probe = f"dlsprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError) as exc:
        return f"cannot make a network namespace: {exc}"
    _ip("netns", "del", probe)
    return None


class Nodes:
    """`count` namespaces, the bridge between them and their storage links; a context manager."""

    def __init__(self, count: int) -> None:
        tag = os.getpid() % 100_000
        self.count = count
        self.names = [f"dls{tag}n{n}" for n in range(count)]
        self._bridge = f"dls{tag}br"
        self._storage_ends = [f"dls{tag}s{n}" for n in range(count)]
        self._octet = tag % 250  # the storage links' /30s: one /24 per run

    def address(self, node: int) -> str:
        """Node `node`'s address on the node network."""
        return f"10.213.0.{2 + node}"

    def storage_host(self, node: int) -> str:
        """The root namespace's end of node `node`'s storage link: where its forwarder listens."""
        return f"10.214.{self._octet}.{4 * node + 1}"

    def command(self, node: int, argv: list[str]) -> list[str]:
        """`argv` run in node `node`'s namespace."""
        return ["ip", "netns", "exec", self.names[node], *argv]

    def __enter__(self) -> Nodes:
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("link", "set", self._bridge, "up")
            for node, name in enumerate(self.names):
                _ip("netns", "add", name)
                _ip("link", "set", "lo", "up", netns=name)
                bridge_end = f"{self._bridge}{node}"
                _ip("link", "add", bridge_end, "type", "veth", "peer", "name", NODE_IFNAME, "netns", name)
                _ip("link", "set", bridge_end, "master", self._bridge, "up")
                _ip("addr", "add", f"{self.address(node)}/24", "dev", NODE_IFNAME, netns=name)
                _ip("link", "set", NODE_IFNAME, "up", netns=name)
                root_end, inside = self._storage_ends[node], "storage0"
                _ip("link", "add", root_end, "type", "veth", "peer", "name", inside, "netns", name)
                _ip("addr", "add", f"{self.storage_host(node)}/30", "dev", root_end)
                _ip("link", "set", root_end, "up")
                host = self.storage_host(node).rsplit(".", 1)
                _ip("addr", "add", f"{host[0]}.{int(host[1]) + 1}/30", "dev", inside, netns=name)
                _ip("link", "set", inside, "up", netns=name)
        except BaseException:
            self.close()
            raise
        return self

    def cut_storage(self, node: int) -> None:
        _ip("link", "set", self._storage_ends[node], "down")

    def restore_storage(self, node: int) -> None:
        _ip("link", "set", self._storage_ends[node], "up")

    def close(self) -> None:
        """Remove the namespaces and links; what was never made is skipped."""
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        for link in [self._bridge, *self._storage_ends]:  # a namespace's removal takes its veths' peers
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)

    def __exit__(self, *exc: object) -> None:
        self.close()
