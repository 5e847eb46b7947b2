"""Where tensors live: TensorLocationSettings and the Options.TensorLocations group."""
from __future__ import annotations

from typing import Any

from pipetorch.errors import OptionAssertionError
from pipetorch.options import _validate as check
from pipetorch.options._group import OptionGroup, readback

__all__ = ["TensorLocationSettings", "_TensorLocationOptions"]


class TensorLocationSettings(OptionGroup):
    """Where one kind of tensor is stored; every method chains.

    >>> opts.TensorLocations.setOptimizerLocation(
    ...     TensorLocationSettings().useOnChipStorage(False))

    Only the optimiser state's settings have an effect here: `useOnChipStorage(False)` keeps
    the state in host memory, streamed in for each update, and
    `useReplicatedTensorSharding(True)` shares it out over the replicas, each keeping 1/R of
    every weight of more than `minElementsForReplicatedTensorSharding` elements
    (parallel/worker/sharded_step.py). Every other setting is stored only.
    """

    _LABEL = "TensorLocationSettings"
    _DEFAULTS = {
        "use_on_chip_storage": None,
        "min_elements_for_off_chip": None,
        "min_elements_for_replicated_tensor_sharding": None,
        "use_replicated_tensor_sharding": None,
        "use_io_tiles_to_load": None,
        "use_io_tiles_to_store": None,
    }

    use_on_chip_storage = readback(
        "use_on_chip_storage", "True: device memory, False: host memory, None: unspecified.")
    min_elements_for_off_chip = readback(
        "min_elements_for_off_chip", "Tensors smaller than this stay on chip (no-op here).")
    min_elements_for_replicated_tensor_sharding = readback(
        "min_elements_for_replicated_tensor_sharding",
        "Only tensors larger than this are sharded over replicas (optimiser state; None: 8192).")
    use_replicated_tensor_sharding = readback(
        "use_replicated_tensor_sharding",
        "Whether to shard over replicas (optimiser state only; weights: no-op here).")
    use_io_tiles_to_load = readback("use_io_tiles_to_load", "Load through IO tiles (no-op here).")
    use_io_tiles_to_store = readback(
        "use_io_tiles_to_store", "Store through IO tiles (no-op here).")

    def useOnChipStorage(self, use: bool | None = True) -> TensorLocationSettings:
        """Keep the tensors in device memory (True) or host memory (False); None: unspecified."""
        if use is not None:
            use = check.boolean("useOnChipStorage", "use", use)
        self._set(use_on_chip_storage=use)
        return self

    def minElementsForOffChip(self, min_elements: int) -> TensorLocationSettings:
        """Never offload tensors with fewer than `min_elements` elements (no-op here)."""
        self._set(min_elements_for_off_chip=check.integer(
            "minElementsForOffChip", "min_elements", min_elements, minimum=0))
        return self

    def minElementsForReplicatedTensorSharding(
            self, min_elements: int) -> TensorLocationSettings:
        """Shard over replicas only tensors with more than `min_elements` elements (default
        8192, PopART's); for the optimiser state, stored only elsewhere."""
        self._set(min_elements_for_replicated_tensor_sharding=check.integer(
            "minElementsForReplicatedTensorSharding", "min_elements", min_elements, minimum=0))
        return self

    def useReplicatedTensorSharding(self, use: bool = True) -> TensorLocationSettings:
        """Shard optimiser state over the replicas, each keeping 1/R of it, as PopTorch does
        (for weights, activations and accumulators: stored only)."""
        self._set(use_replicated_tensor_sharding=check.boolean(
            "useReplicatedTensorSharding", "use", use))
        return self

    def useIOTilesToLoad(self, use: bool = True) -> TensorLocationSettings:
        """Load the tensors through IO tiles (no-op here)."""
        self._set(use_io_tiles_to_load=check.boolean("useIOTilesToLoad", "use", use))
        return self

    def useIOTilesToStore(self, use: bool = True) -> TensorLocationSettings:
        """Store the tensors through IO tiles (no-op here)."""
        self._set(use_io_tiles_to_store=check.boolean("useIOTilesToStore", "use", use))
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorLocationSettings):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # type: ignore[assignment]  # mutable, so unhashable like a dict


_KINDS = ("activation", "weight", "optimizer", "accumulator")


def _snapshot_of(setter: str, location: object) -> dict[str, Any]:
    if not isinstance(location, TensorLocationSettings):
        raise check.type_error(setter, "location", location,
                               "a poptorch.TensorLocationSettings, e.g. "
                               "TensorLocationSettings().useOnChipStorage(False)")
    # A snapshot: later edits of the user's object must not change frozen options.
    return dict(location._values)


# TensorLocationSettings' values under the names PopTorch's `location_<kind>` dicts use
_POPTORCH_NAMES = {
    "use_on_chip_storage": "onChip",
    "min_elements_for_off_chip": "minElementsForOffChip",
    "min_elements_for_replicated_tensor_sharding": "minElementsForReplicatedTensorSharding",
    "use_replicated_tensor_sharding": "useReplicatedTensorSharding",
    "use_io_tiles_to_load": "useIOTilesToLoad",
    "use_io_tiles_to_store": "useIOTilesToStore",
}


def _poptorch_dict(kind: str) -> property:
    def get(self: _TensorLocationOptions) -> dict[str, Any]:
        snapshot = self._values[f"{kind}_location"] or {}
        return {_POPTORCH_NAMES[k]: v for k, v in snapshot.items() if v is not None}

    return property(get, doc=f"PopTorch's `location_{kind}`: the settings given to "
                             f"set{kind.capitalize()}Location by PopTorch's names "
                             "(onChip, useReplicatedTensorSharding, ...); {} if unset.")


def _location(kind: str) -> property:
    def get(self: _TensorLocationOptions) -> TensorLocationSettings | None:
        snapshot = self._values[f"{kind}_location"]
        if snapshot is None:
            return None
        settings = TensorLocationSettings()
        settings._values.update(snapshot)
        return settings

    return property(get, doc=f"TensorLocationSettings for {kind} tensors, or None if unset.")


class _TensorLocationOptions(OptionGroup):
    """Where activations, weights, optimiser state and accumulators live."""

    _LABEL = "Options.TensorLocations"
    _DEFAULTS = {f"{kind}_location": None for kind in _KINDS} | {
        "num_io_tiles": 0}

    activation_location = _location("activation")
    weight_location = _location("weight")
    optimizer_location = _location("optimizer")
    accumulator_location = _location("accumulator")
    num_io_tiles = readback("num_io_tiles", "IPU tiles reserved for IO (no-op here).")
    location_activation = _poptorch_dict("activation")
    location_weight = _poptorch_dict("weight")
    location_optimizer = _poptorch_dict("optimizer")
    location_accumulator = _poptorch_dict("accumulator")

    def setActivationLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        """Where activations are stored (no-op here)."""
        self._set(activation_location=_snapshot_of("setActivationLocation", location))
        return self

    def setWeightLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        """Where weights are stored (no-op here)."""
        self._set(weight_location=_snapshot_of("setWeightLocation", location))
        return self

    def setOptimizerLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        """Where optimiser state is stored.

        `useOnChipStorage(False)` keeps the state in host memory: device memory drops by its
        size, updates get slower, numbers do not change. `useReplicatedTensorSharding(True)`
        shares it out over the replicas (docs/machines.md), numbers unchanged too.
        """
        self._set(optimizer_location=_snapshot_of("setOptimizerLocation", location))
        return self

    def setAccumulatorLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        """Where gradient accumulators are stored (no-op here)."""
        self._set(accumulator_location=_snapshot_of("setAccumulatorLocation", location))
        return self

    def numIOTiles(self, num_tiles: int) -> _TensorLocationOptions:
        """Reserve `num_tiles` IPU tiles for IO: an even number in [32, 192] (no-op here)."""
        num_tiles = check.integer("numIOTiles", "num_tiles", num_tiles)
        if num_tiles % 2 or not 32 <= num_tiles <= 192:
            # PopTorch asserts this; scripts catch AssertionError (this is also a ValueError)
            raise OptionAssertionError(
                f"numIOTiles must be an even number between 32 and 192. Got {num_tiles}; "
                "pass an even value in [32, 192]")
        self._set(num_io_tiles=num_tiles)
        return self
