"""The other host processes of one pipeline: who and where each is, and whether it still runs.

Each host process listens on a port of its own and, at start-up, every pair of processes
opens one TCP connection between them (the lower process connects). Nothing is ever sent on
it: a process that ends, however it ends (SIGKILL included), has its connections closed by
its kernel, so its peers see end-of-file at once and can name it, with its exit status when
it ran on the same machine and is not yet reaped.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from pipetorch.parallel.layout.placement import running

__all__: list[str] = []

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def machine_id() -> str:
    """One name per running kernel and host name: two processes with the same one share the
    machine's cores and see each other's pids."""
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class Identity:
    """A host process as the others name it."""

    process: int
    host: str       # its host name
    machine: str    # machine_id()
    pid: int
    address: tuple[str, int]  # its listener

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}"

    @classmethod
    def parse(cls, text: str) -> Identity:
        """An Identity from its fields as JSON (`dataclasses.asdict`)."""
        fields = json.loads(text)
        return cls(**{**fields, "address": tuple(fields["address"])})


class Liveness:
    """This process's listener and its connections to the other host processes."""

    def __init__(self, process: int, toward: str) -> None:
        self.process = process
        self._listener = socket.create_server(("", 0))
        self._listener.settimeout(None)
        self.me = Identity(process, socket.gethostname(), machine_id(), os.getpid(),
                           (_local_address(toward), self._listener.getsockname()[1]))
        self._links: dict[int, socket.socket] = {}

    def connect(self, others: list[Identity], timeout: float) -> None:
        """One connection to every other process: made to the later ones, taken from the
        earlier ones (each says which it is in 4 bytes)."""
        for other in others:
            if other.process > self.process:
                link = socket.create_connection(other.address, timeout=timeout)
                link.sendall(struct.pack("!i", self.process))
                self._links[other.process] = link
        self._listener.settimeout(timeout)
        for _ in [o for o in others if o.process < self.process]:
            link, _ = self._listener.accept()
            link.settimeout(timeout)
            self._links[struct.unpack("!i", _read(link, 4))[0]] = link
        self._listener.close()

    def gone(self, wait: float = 0.0) -> list[int]:
        """The processes whose connection has closed (waiting up to `wait` seconds for one)."""
        deadline = time.monotonic() + wait
        while True:
            found = [q for q, link in self._links.items() if _closed(link)]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.02)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._listener.close()


def ending(who: Identity) -> str:
    """How process `who`, whose connection closed, ended: its exit status when it ran on this
    machine and its parent has not collected it yet, else that it exited or was killed."""
    if who.machine == machine_id():
        deadline = time.monotonic() + 2.0  # its kernel closes its sockets as it ends
        while running(who.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if running(who.pid):
            return "closed its connections while still running (it may be ending)"
        code = _zombie_status(who.pid)
        if code is not None:
            if code & 0x7F:
                return f"was killed by {_signal_name(code & 0x7F)}"
            return f"exited with code {code >> 8}"
    return "exited or was killed"


def _zombie_status(pid: int) -> int | None:
    """The wait status of a process that ended but is not yet reaped (/proc's exit_code)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # fields[0] is the state (field 3 of proc(5)); exit_code is field 52
    return int(fields[49]) if fields and fields[0] == "Z" and len(fields) > 49 else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _local_address(toward: str) -> str:
    """This machine's address on the route to `toward` (the others' way back to it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((toward, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _read(link: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = link.recv(size - len(data))
        if not chunk:
            raise ConnectionError("a host process closed its connection during start-up")
        data += chunk
    return data


def _closed(link: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([link], [], [], 0)
        return bool(readable) and link.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True
