"""Host memory a replica all-reduce adds: one buffer per dtype against 25 MiB buckets.

A GPT-2-small-like stack of linear layers (12 x 768<->3072 and a 50257 x 768 head, 381 MB of
fp32 gradients) is summed by PeerLink.all_reduce in a one-process gloo group, each setting in
a fresh interpreter. The number is the peak resident memory (VmHWM, reset just before) above
the resident memory before the call. "one buffer per dtype" is the all-reduce before
bucketing (a bucket limit above the gradients' size); "25 MiB buckets" is the default.

    python benchmarks/allreduce_memory.py
"""
from __future__ import annotations

import subprocess
import sys

LIMITS = {"one buffer per dtype (before bucketing)": 1 << 62, "25 MiB buckets": None}


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


def child(limit: int | None) -> None:
    """Print the gradients' bytes and the peak memory the all-reduce added."""
    import torch
    import torch.distributed as dist

    from pipetorch.parallel.comm.transport import PeerLink

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(768, 3072) if i % 2 == 0 else torch.nn.Linear(3072, 768)
              for i in range(24)]
    grads = [torch.randn_like(p) for p in torch.nn.Sequential(
        *layers, torch.nn.Linear(768, 50257)).parameters()]
    link = PeerLink(device=torch.device("cpu"), wire_device=torch.device("cpu"), timeout=60)
    if limit is not None:
        link.bucket_bytes = limit
    link.all_reduce([torch.ones(4)])  # gloo's own buffers, before the measurement
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM := VmRSS
    before = _rss("VmRSS:")
    link.all_reduce(grads)
    print(sum(g.numel() * g.element_size() for g in grads), _rss("VmHWM:") - before)
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(None if sys.argv[2] == "default" else int(sys.argv[2]))
        return
    print("replica all-reduce, gloo on the CPU: peak host memory it adds")
    for name, limit in LIMITS.items():
        done = subprocess.run([sys.executable, __file__, "--child", str(limit or "default")],
                              capture_output=True, text=True, check=True)
        gradients, added = map(int, done.stdout.split())
        print(f"  {name:<42} {added / 1e6:8.1f} MB added  ({gradients / 1e6:.1f} MB of "
              f"gradients, ratio {added / gradients:.3f})")


if __name__ == "__main__":
    main()
