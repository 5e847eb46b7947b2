"""Running stages on several devices, by the process that runs the code: layout (compile-time)
< comm (between processes) < worker and generation (in a device's worker) < host (the user's
process)."""
