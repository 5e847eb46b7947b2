"""Running stages in worker processes: routes, transport, the stage executor, the host engine."""
