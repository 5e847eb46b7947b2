"""Between processes: the host-worker messages and their wire, shared-memory arenas and rings, worker-to-worker bundles, the process group's rendezvous."""
