"""`pipetorch devices`: the physical devices, their memory and the device workers on each."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TypeAlias, TypedDict

from pipetorch import environment

__all__ = ["register", "render_text", "snapshot"]

_HELP = "list the CPU and GPUs, their memory and the pipetorch workers attached to each"
_DESCRIPTION = """\
List the physical devices pipetorch can run stages on (the CPU, and every CUDA GPU when
torch sees one), their memory, and the live pipetorch workers attached to each (one per
logical device and replica, running every stage on it), like `gc-monitor` lists IPUs and the
processes attached to them. Registry files of workers that
died without cleaning up are deleted on the way. Also shows the device pipetorch uses by
default and the PIPETORCH_* variables that change it.

--json prints one object:
  registry          the folder workers register in ($PIPETORCH_REGISTRY or $TMPDIR/pipetorch-UID)
  environment       {name: value} of PIPETORCH_DEVICE, PIPETORCH_NUM_DEVICES,
                    PIPETORCH_THREADS_PER_DEVICE, only those set
  default           {device: "cpu" | "cuda" | "cuda:N" | null, devices: [names stage workers
                    are placed on], cores: CPU cores shared out among workers (null on GPUs),
                    threads_per_worker: int | null (null: cores // workers), error: str | null}
  cpu_threads       {requested: CPU threads all live workers ask for, cores: usable cores}
  devices           list, the CPU first, then GPUs by index, then devices that workers name
                    but this process cannot see; each:
    device          "cpu" or "cuda:N"
    type, index     "cpu" / "cuda"; GPU index (null for the CPU)
    name            CPU model or GPU name (null when unknown)
    cores           cores usable by this process (CPU; null for GPUs)
    cores_total     cores of the machine (CPU; null for GPUs)
    memory_total, memory_available   bytes (null when unknown)
    visible         false for a device a worker names that this process cannot see
    workers         list of {pid, host_pid, stages, ipu, device, threads, rss}; stages
                    lists the stages the worker runs; rss is the resident memory in bytes
                    (null when /proc/PID/status is unreadable)"""

# A module attribute so tests can point it at a folder without the files (as on macOS).
_PROC = Path("/proc")
# The variables that choose where stage workers go (placement.physical).
_ENV_NAMES = tuple(map(environment.variable, ("device", "num_devices", "threads_per_device")))

# A value as json.loads reads it (a worker's registry file).
JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"


class Worker(TypedDict):
    """A live worker: its registry record (placement.register writes ints, a list of stages
    and the device name; unchecked, as read back) and its resident memory in bytes."""

    pid: JsonValue
    host_pid: JsonValue
    stages: JsonValue
    ipu: JsonValue
    device: JsonValue
    threads: JsonValue
    rss: int | None


class Device(TypedDict):
    """One entry of `devices` (the fields are described in _DESCRIPTION)."""

    device: str
    type: str
    index: int | None
    name: str | None
    cores: int | None
    cores_total: int | None
    memory_total: int | None
    memory_available: int | None
    visible: bool
    workers: list[Worker]


class Default(TypedDict):
    """Where stage workers would go now."""

    device: str | None
    devices: list[str]
    cores: int | None
    threads_per_worker: int | None
    error: str | None


class CpuThreads(TypedDict):
    requested: int
    cores: int


class Snapshot(TypedDict):
    """What `pipetorch devices --json` prints."""

    registry: str
    environment: dict[str, str]
    default: Default
    cpu_threads: CpuThreads
    devices: list[Device]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `devices` subcommand to the `pipetorch` parser."""
    parser = subparsers.add_parser(
        "devices", help=_HELP, description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true",
                        help="print the listing as one JSON object (structure above)")
    parser.set_defaults(command=_command, parser=parser)


def _command(args: argparse.Namespace) -> int:
    state = snapshot()
    try:
        print(json.dumps(state, indent=2) if args.json else render_text(state), flush=True)
    except BrokenPipeError:
        # `pipetorch devices | head`: the reader left; keep Python's exit flush from failing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


# -- gathering ---------------------------------------------------------------------------------
def snapshot() -> Snapshot:
    """Everything `pipetorch devices` shows, as the JSON-ready object `--json` prints."""
    # Imported here, not at the top: `pipetorch --version` builds every subcommand's parser
    # and should not pay for importing torch.
    from pipetorch.parallel.layout import placement

    workers = [_worker(record) for record in placement.live_workers()]
    workers.sort(key=lambda w: (_int(w["host_pid"]), _int(w["ipu"]), _int(w["pid"])))
    devices = [_cpu(placement.cpu_cores()), *_gpus()]
    known = {d["device"]: d for d in devices}
    for worker in workers:
        name = str(worker["device"])
        if name not in known:
            known[name] = _unseen(name)
            devices.append(known[name])
        known[name]["workers"].append(worker)
    return {
        "registry": str(placement.registry_dir()),
        "environment": {n: os.environ[n] for n in _ENV_NAMES if n in os.environ},
        "default": _default(placement),
        "cpu_threads": {"requested": sum(_int(w["threads"]) for w in workers),
                        "cores": placement.cpu_cores()},
        "devices": devices,
    }


def _device(device: str, kind: str, index: int | None, *, name: str | None = None,
            cores: int | None = None, cores_total: int | None = None,
            memory_total: int | None = None, memory_available: int | None = None,
            visible: bool = True) -> Device:
    return {"device": device, "type": kind, "index": index, "name": name, "cores": cores,
            "cores_total": cores_total, "memory_total": memory_total,
            "memory_available": memory_available, "visible": visible, "workers": []}


def _cpu(cores: int) -> Device:
    total, available = _host_memory()
    return _device("cpu", "cpu", None, name=_cpu_model(), cores=cores,
                   cores_total=os.cpu_count(), memory_total=total, memory_available=available)


def _gpus() -> list[Device]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        try:
            free, total = torch.cuda.mem_get_info(index)
        except RuntimeError:  # e.g. a GPU in exclusive-process mode held by another process
            free, total = None, props.total_memory
        gpus.append(_device(f"cuda:{index}", "cuda", index, name=props.name,
                            memory_total=total, memory_available=free))
    return gpus


def _unseen(name: str) -> Device:
    # A worker started with other CUDA_VISIBLE_DEVICES (or on a GPU torch here cannot open).
    kind, _, index = name.partition(":")
    return _device(name, kind, int(index) if index.isdigit() else None, visible=False)


def _cpu_model() -> str | None:
    try:
        with open(_PROC / "cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of RAM: /proc/meminfo, else sysconf, else unknown."""
    try:
        fields = _kib_fields((_PROC / "meminfo").read_text())
        available = fields.get("MemAvailable", fields.get("MemFree"))
        return fields.get("MemTotal"), available
    except OSError:
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None, None
    try:
        return total, page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES
        return total, None


def _kib_fields(text: str) -> dict[str, int]:
    """`Name:  1234 kB` lines (the format of /proc/meminfo and /proc/PID/status), in bytes."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * 1024
    return fields


def _worker(record: Mapping[str, JsonValue]) -> Worker:
    pid = record.get("pid")
    return {"pid": pid, "host_pid": record.get("host_pid"), "stages": record.get("stages"),
            "ipu": record.get("ipu"), "device": record.get("device"),
            "threads": record.get("threads"), "rss": _rss(pid)}


def _rss(pid: JsonValue) -> int | None:
    if not isinstance(pid, (int, float, str)):
        return None
    try:
        return _kib_fields((_PROC / str(int(pid)) / "status").read_text()).get("VmRSS")
    except (OSError, TypeError, ValueError):
        return None


def _int(value: JsonValue) -> int:
    return value if isinstance(value, int) else 0


def _default(placement: ModuleType) -> Default:
    """Where stage workers would go now (`placement.physical`, which `place` follows)."""
    from pipetorch.errors import ConfigError
    from pipetorch.parallel.layout.placement import default_device

    result: Default = {"device": None, "devices": [], "cores": None,
                              "threads_per_worker": None, "error": None}
    try:
        device = default_device()
        found = placement.physical()
    except ConfigError as exc:
        return result | {"error": str(exc)}
    result["device"] = str(device)
    if device.type == "cuda":
        return result | {"devices": list(found.devices)}
    return result | {"devices": ["cpu"], "cores": found.cores, "threads_per_worker": found.threads}


# -- rendering ---------------------------------------------------------------------------------
def render_text(state: Snapshot) -> str:
    """The human-readable listing of a `snapshot()`."""
    lines = [f"Registry: {state['registry']}",
             f"Default: {_describe_default(state['default'])}",
             "Environment: " + (" ".join(f"{k}={v}" for k, v in state["environment"].items())
                                or f"none of {', '.join(_ENV_NAMES)} set"),
             ""]
    header = ("DEVICE", "NAME", "CORES", "MEMORY", "AVAILABLE")
    rows = [_device_row(d) for d in state["devices"]]
    widths = _widths([header, *rows])
    lines.append(_line(header, widths))
    for device, row in zip(state["devices"], rows, strict=True):
        lines.append(_line(row, widths))
        lines.extend("  " + line for line in _attached(device, state["cpu_threads"]))
    return "\n".join(lines)


def _describe_default(default: Default) -> str:
    if default["error"]:
        return f"unusable: {default['error']}"
    if (default["device"] or "").startswith("cuda"):
        return f"{default['device']} (stage workers go to {', '.join(default['devices'])})"
    threads = default["threads_per_worker"]
    share = f"{threads} thread(s) each" if threads else "cores // workers thread(s) each"
    return f"cpu (stage workers share {default['cores']} core(s), {share})"


def _device_row(device: Device) -> tuple[str, ...]:
    name = device["name"] or ("unknown" if device["visible"] else "(not visible here)")
    cores = "-"
    if device["cores"] is not None:
        cores = f"{device['cores']} of {device['cores_total'] or '?'}"
    return (device["device"], name, cores, _size(device["memory_total"]),
            _size(device["memory_available"]))


def _attached(device: Device, cpu_threads: CpuThreads) -> list[str]:
    workers = device["workers"]
    lines = []
    if device["type"] == "cpu" and cpu_threads["requested"]:
        oversubscribed = cpu_threads["requested"] > cpu_threads["cores"]
        lines.append(f"CPU threads asked for by all workers: {cpu_threads['requested']} of "
                     f"{cpu_threads['cores']} usable core(s)"
                     + (" (oversubscribed: workers take turns)" if oversubscribed else ""))
    if not workers:
        return [*lines, "No attached processes"]
    header = ("PID", "HOST PID", "IPU", "STAGES", "THREADS", "RSS")
    rows = [tuple(_text(w[k]) for k in ("pid", "host_pid", "ipu", "stages", "threads"))
            + (_size(w["rss"]),) for w in workers]
    widths = _widths([header, *rows])
    return [*lines, f"{len(workers)} attached process(es):",
            *("  " + _line(row, widths) for row in [header, *rows])]


def _widths(rows: Sequence[Sequence[str]]) -> list[int]:
    return [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]


def _line(row: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()


def _text(value: JsonValue) -> str:
    if isinstance(value, list):  # a worker's stages: "0,2"
        return ",".join(map(str, value)) or "-"
    return "-" if value is None else str(value)


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
