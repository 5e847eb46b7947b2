"""Environment variables that PopTorch's Options read, parsed and validated."""
from __future__ import annotations

import json
import os
from typing import Any, TypeAlias, Union

import torch

from pipetorch import enums
from pipetorch.errors import ConfigError
from pipetorch.options._validate import directory_problem

__all__ = [
    "CACHE_DIR_VAR", "DEFAULT_OPTIONS_VAR", "ENGINE_OPTIONS_VAR", "cache_dir", "profiling_dir",
    "default_options", "process_from_env",
]

CACHE_DIR_VAR = "POPTORCH_CACHE_DIR"
DEFAULT_OPTIONS_VAR = "POPTORCH_DEFAULT_OPTIONS"
ENGINE_OPTIONS_VAR = "POPLAR_ENGINE_OPTIONS"
# (count variable, rank variable): OpenMPI's as in PopTorch, then torchrun's.
DEFAULT_PROCESS_VARS = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("WORLD_SIZE", "RANK"))
# Poplar writes reports to the working directory when autoReport.directory is not given.
DEFAULT_REPORT_DIR = "./"
# A value as json.loads gives it.
_Json: TypeAlias = Union[None, bool, int, float, str, list["_Json"], dict[str, "_Json"]]


def cache_dir() -> str | None:
    """POPTORCH_CACHE_DIR if set and non-empty: the executable cache directory (a writable
    directory, or a path where one can be created)."""
    directory = os.environ.get(CACHE_DIR_VAR) or None
    problem = directory and directory_problem(directory)
    if problem:
        raise ConfigError(f"Environment variable {CACHE_DIR_VAR}={directory!r} {problem}: set "
                          "it to a directory for the executable cache (created if missing) "
                          f"that this process can write to, or unset it")
    return directory


def _json_object(var: str, example: str) -> dict[str, _Json] | None:
    raw = os.environ.get(var, "").strip()
    if not raw:
        return None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{var} is not valid JSON ({err}): {raw!r}. Expected an object "
                          f"such as {example}") from err
    if not isinstance(parsed, dict):
        raise ConfigError(f"{var} must hold a JSON object such as {example}; got {raw!r}")
    return parsed


def profiling_dir() -> str | None:
    """The report directory POPLAR_ENGINE_OPTIONS asks for, or None if it asks for none.

    Reports are requested by `"autoReport.all": "true"`; they go to `autoReport.directory`,
    or to the working directory ("./") when that is not given.
    """
    engine = _json_object(ENGINE_OPTIONS_VAR,
                          '{"autoReport.all": "true", "autoReport.directory": "./reports"}')
    if engine is None or str(engine.get("autoReport.all", "false")).lower() != "true":
        return None
    directory = engine.get("autoReport.directory", DEFAULT_REPORT_DIR)
    if not isinstance(directory, str) or not directory:
        raise ConfigError(f'{ENGINE_OPTIONS_VAR}: "autoReport.directory" must be a non-empty '
                          f"string; got {directory!r}")
    problem = directory_problem(directory)
    if problem:
        raise ConfigError(
            f'Environment variable {ENGINE_OPTIONS_VAR}: "autoReport.directory" {directory!r} '
            f"{problem}: name a directory for the profiling reports (created if missing) that "
            'this process can write to, or drop "autoReport.all"')
    return directory


def _decode(value: _Json) -> Any:
    """JSON can't spell enums or dtypes: "OutputMode.All" and "torch.float16" stand for them."""
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, str) and value.count(".") == 1:
        owner, member = value.split(".")
        if owner in enums.__all__:
            enum_cls = getattr(enums, owner)
            if member in enum_cls.__members__:
                return enum_cls[member]
        if owner == "torch" and isinstance(getattr(torch, member, None), torch.dtype):
            return getattr(torch, member)
    return value


def default_options() -> list[tuple[str, list[Any]]]:
    """POPTORCH_DEFAULT_OPTIONS as (dotted setter, positional args) pairs, in file order.

    `{"deviceIterations": 3, "Training.gradientAccumulation": 2}` calls
    `deviceIterations(3)` then `Training.gradientAccumulation(2)`. A JSON list value is
    spread as the arguments (`{"outputMode": ["OutputMode.EveryN", 2]}`); wrap a list meant
    as one argument in another list. Strings "OutputMode.All" / "torch.float16" become the
    enum member / dtype.
    """
    parsed = _json_object(DEFAULT_OPTIONS_VAR,
                          '{"deviceIterations": 3, "Training.gradientAccumulation": 2}')
    if parsed is None:
        return []
    return [(name, _decode(value) if isinstance(value, list) else [_decode(value)])
            for name, value in parsed.items()]


def _env_int(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError as err:
        raise ConfigError(f"Environment variable {var} must be an integer; got {raw!r}") from err


def process_from_env(names: tuple[str, str] | None) -> tuple[int, int]:
    """(process id, process count) from `names` = (count variable, id variable).

    Without names: OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_RANK, else torchrun's WORLD_SIZE /
    RANK, else (0, 1). A pair is used when either of its variables is set.
    """
    pairs = (names,) if names is not None else DEFAULT_PROCESS_VARS
    for count_var, id_var in pairs:
        if count_var in os.environ or id_var in os.environ:
            count, process_id = _env_int(count_var, 1), _env_int(id_var, 0)
            if count < 1 or not 0 <= process_id < count:
                raise ConfigError(
                    f"Environment variables {id_var}={process_id} and {count_var}={count} "
                    f"need 0 <= {id_var} < {count_var}; fix them or call "
                    "opts.Distributed.configureProcessId(process_id, num_processes)")
            return process_id, count
    return 0, 1
