"""Runs in a device's worker process: the stage executor, its transfers, backward, recomputation, the replicas' reductions and step."""
