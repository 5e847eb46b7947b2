"""IPU-only Options knobs (stored so PopTorch scripts run, no-op here) and the memory budget."""
from __future__ import annotations

import numbers
import re
from typing import TYPE_CHECKING, Any

from pipetorch.enums import ConnectionType, OutputMode, SyncPattern
from pipetorch.options import _validate as check
from pipetorch.options._group import OptionGroup, readback

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["IpuSetters"]

_IPU_KEY = re.compile(r"IPU\d+")
_IPU_VERSIONS = (1, 2, 21)  # Mk1, Mk2, Bow
# SI prefixes are powers of 1000, binary ones powers of 1024 ("897MB" != "897MiB").
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)\s*")
_BUDGET_FORMS = ('bytes as an int > 0, a size string such as "897MB", "16GB" or "512 MiB" '
                 '(B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024), '
                 'a dict of those per logical device such as {"IPU0": "897MB", "IPU1": "897MB"}, '
                 "or None for no budget")


def _budget_bytes(arg: str, value: int | str) -> int:
    """One device's budget in bytes, from an int or a size string."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise check.type_error("setMemoryBudget", arg, value, _BUDGET_FORMS)
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise check.value_error("setMemoryBudget", arg, value, _BUDGET_FORMS)
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if number != int(number):
            raise check.value_error("setMemoryBudget", arg, value,
                                    "a whole number of bytes; " + _BUDGET_FORMS)
        value = int(number)
    if value <= 0:
        raise check.value_error("setMemoryBudget", arg, value, _BUDGET_FORMS)
    return int(value)


class IpuSetters(OptionGroup):
    """The part of `Options` that only matters on IPU hardware (no effect here), and the
    per-device memory budget that compile checks its estimate against."""

    _OWN_DEFAULTS: dict[str, Any] = {
        "use_ipu_model": False,
        "ipu_id": None,
        "ipu_version": None,
        "connection_type": ConnectionType.Always,
        "sync_pattern": SyncPattern.Full,
        "available_memory_proportion": {},
        "anchored_tensors": {},
        "stable_norm": False,
        "log_cycle_count": False,
        "module_namescope_enabled": True,
        "source_location_excludes": [],
        "memory_budget": None,
    }

    use_ipu_model = readback("use_ipu_model", "Whether the IPU Model simulator was asked for.")
    ipu_id = readback("ipu_id", "The IPU device id asked for, or None.")
    ipu_version = readback("ipu_version", "Offline target IPU version, or None.")
    connection_type = readback("connection_type", "When to attach to the IPU.")
    sync_pattern = readback("sync_pattern", "IPU host-sync pattern.")
    available_memory_proportion = readback(
        "available_memory_proportion", 'Temporary memory per IPU, e.g. {"IPU0": 0.5}.')
    anchored_tensors = readback("anchored_tensors", "PopART tensors anchored by short name.")
    stable_norm = readback("stable_norm", "Whether stable norm kernels were asked for.")
    log_cycle_count = readback("log_cycle_count", "Whether IPU cycle counts are logged.")
    module_namescope_enabled = readback(
        "module_namescope_enabled", "Whether op names carry their module's name.")
    source_location_excludes = readback(
        "source_location_excludes", "Frames ignored when tracing op source locations.")
    memory_budget = readback(
        "memory_budget", "Bytes each logical device may use: an int for every device, a dict "
        "{ipu index: bytes}, or None (no check on the CPU; a GPU's total memory on a GPU).")

    def useIpuModel(self, use_model: bool) -> Self:
        """Run on the IPU Model simulator instead of hardware (no-op here)."""
        self._set(use_ipu_model=check.boolean("useIpuModel", "use_model", use_model))
        return self

    def useIpuId(self, ipu_id: int) -> Self:
        """Use the IPU device with this id, as listed by gc-info (no-op here)."""
        self._set(ipu_id=check.integer("useIpuId", "ipu_id", ipu_id, minimum=0))
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Self:
        """Compile for an IPU version without attaching, sets ConnectionType.Never (no-op here)."""
        if check.integer("useOfflineIpuTarget", "ipu_version", ipu_version) not in _IPU_VERSIONS:
            raise check.value_error("useOfflineIpuTarget", "ipu_version", ipu_version,
                                    "one of 1 (Mk1), 2 (Mk2), 21 (Bow)")
        self._set(ipu_version=int(ipu_version), connection_type=ConnectionType.Never)
        return self

    def connectionType(self, connection_type: ConnectionType) -> Self:
        """When to attach to the IPU: Always, OnDemand or Never (no-op here)."""
        self._set(connection_type=check.enum_member(
            "connectionType", "connection_type", connection_type, ConnectionType))
        return self

    def syncPattern(self, sync_pattern: SyncPattern) -> Self:
        """IPU synchronisation: Full, SinglePipeline or ReplicaAndLadder (no-op here)."""
        self._set(sync_pattern=check.enum_member(
            "syncPattern", "sync_pattern", sync_pattern, SyncPattern))
        return self

    def setAvailableMemoryProportion(
            self, available_memory_proportion: dict[str, float]) -> Self:
        """Temporary memory for matmuls/convolutions per IPU, e.g. {"IPU0": 0.5} (no-op here).

        Keys are "IPU<n>", values in (0, 1].
        """
        setter, arg = "setAvailableMemoryProportion", "available_memory_proportion"
        if not isinstance(available_memory_proportion, dict):
            raise check.type_error(setter, arg, available_memory_proportion,
                                   'a dict such as {"IPU0": 0.5}')
        for key, value in available_memory_proportion.items():
            if not isinstance(key, str) or not _IPU_KEY.fullmatch(key):
                raise check.value_error(setter, "every key", key,
                                        '"IPU<n>" where n is the IPU index, e.g. "IPU0"')
            check.proportion(setter, f"{arg}[{key!r}]", value)
        self._set(available_memory_proportion={
            k: float(v) for k, v in available_memory_proportion.items()})
        return self

    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: OutputMode | None = None,
                     output_return_period: int | None = 1) -> Self:
        """Return PopART tensor `long_name` as `short_name` after each run (no-op here).

        `output_mode` None means the same mode as the model's outputs.
        """
        short_name = check.text("anchorTensor", "short_name", short_name)
        long_name = check.text("anchorTensor", "long_name", long_name)
        if output_mode is not None:
            check.enum_member("anchorTensor", "output_mode", output_mode, OutputMode)
        period = 1
        if output_mode == OutputMode.EveryN:
            period = check.integer("anchorTensor", "output_return_period",
                                   output_return_period, minimum=1)
        self._check_not_frozen()
        self._values["anchored_tensors"][short_name] = {
            "long_name": long_name, "output_mode": output_mode, "output_return_period": period}
        return self

    def setMemoryBudget(self, budget: int | str | dict[str, int | str] | None) -> Self:
        """Memory each logical device may use; pipetorch extension (PopTorch has none).

        The model is refused at compile time, with remedies, when the estimated peak of a
        device exceeds it. `budget` is bytes (int), a size string ("897MB", "16GB",
        "512 MiB"; KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024), or a dict per
        logical device ({"IPU0": "897MB", "IPU1": "1GB"}; devices not named are not
        checked). None removes the budget: then a GPU's total memory is the budget, and on
        the CPU nothing is checked. Read back as bytes: `memory_budget` is an int, a dict
        {ipu index: bytes}, or None.
        """
        if budget is None:
            self._set(memory_budget=None)
            return self
        if isinstance(budget, dict):
            if not budget:
                raise check.value_error("setMemoryBudget", "budget", budget, _BUDGET_FORMS)
            per_device = {}
            for key, value in budget.items():
                if not isinstance(key, str) or not _IPU_KEY.fullmatch(key):
                    raise check.value_error("setMemoryBudget", "every key", key,
                                            '"IPU<n>" where n is the logical device index, '
                                            'e.g. "IPU0"')
                per_device[int(key[3:])] = _budget_bytes(f"budget[{key!r}]", value)
            self._set(memory_budget=per_device)
            return self
        self._set(memory_budget=_budget_bytes("budget", budget))
        return self

    def enableStableNorm(self, enabled: bool) -> Self:
        """Use the slower, more accurate norm kernels (no-op here)."""
        self._set(stable_norm=check.boolean("enableStableNorm", "enabled", enabled))
        return self

    def logCycleCount(self, log_cycle_count: bool) -> Self:
        """Log the IPU cycles of each run (no-op here)."""
        self._set(log_cycle_count=check.boolean(
            "logCycleCount", "log_cycle_count", log_cycle_count))
        return self

    def disableModuleNamescope(self) -> Self:
        """Stop prefixing op names with their module's name (no-op here)."""
        self._set(module_namescope_enabled=False)
        return self

    def sourceLocationExcludes(self, excludes: list[str]) -> Self:
        """Replace the frames ignored when recording op source locations (no-op here)."""
        self._set(source_location_excludes=check.strings(
            "sourceLocationExcludes", "excludes", excludes))
        return self

    def appendToLocationExcludes(self, *excludes: str) -> Self:
        """Add frames to ignore when recording op source locations (no-op here)."""
        extra = check.strings("appendToLocationExcludes", "excludes", excludes)
        self._set(source_location_excludes=self._values["source_location_excludes"] + extra)
        return self
