"""One bundle between two worker processes: shared memory (ShmLink) against gloo (PeerLink).

Two processes bounce a bundle of one float32 tensor back and forth through the same link class
the stage workers use; the time of one crossing is half a round trip (median over the
round trips after a warm-up). Sizes as in ../shared/docs/measurements.md: 4 KB, 1 MB, 16 MB.

    python benchmarks/transport.py            # 200 / 50 / 10 round trips per size
    python benchmarks/transport.py --quick
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetorch.parallel.layout.routes import TensorSpec
from pipetorch.parallel.comm.shm import new_link, segment_prefix
from pipetorch.parallel.comm.transport import BundleLayout, ChannelSpec, Tag

SIZES = {"4 KB": 1 << 10, "1 MB": 1 << 18, "16 MB": 1 << 22}  # float32 elements


def _bounce(rank: int, store: str, kind: str, trips: dict[str, int], results: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    cpu = torch.device("cpu")
    peer = 1 - rank
    layouts = {name: BundleLayout((TensorSpec((n,), torch.float32, False),))
               for name, n in SIZES.items()}
    link = new_link(kind, prefix=segment_prefix(os.getppid(), f"bench/{kind}"), rank=rank,
                    device=cpu, wire_device=cpu, timeout=120)
    # one ring each way, its slots sized for the largest bundle
    largest = max(layout.nbytes for layout in layouts.values())
    link.open([ChannelSpec(peer, Tag.ACTIVATIONS, outgoing, largest) for outgoing in (True, False)])
    try:
        for name, layout in layouts.items():
            tensor, tag = torch.randn(SIZES[name]), Tag.ACTIVATIONS
            seconds = []
            for trip in range(trips[name] + 3):  # 3 warm-up trips
                start = time.perf_counter()
                if rank == 0:
                    link.send(layout, [tensor], peer, tag)
                    link.recv(layout, peer, tag)
                else:
                    received = link.recv(layout, peer, tag)
                    link.send(layout, received, peer, tag)
                link.flush()
                seconds.append(time.perf_counter() - start)
            if rank == 0:
                results.put((name, statistics.median(seconds[3:]) / 2))
    finally:
        link.close()
        dist.destroy_process_group()


def one_way(kind: str, trips: dict[str, int]) -> dict[str, float]:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="transport-bench-") as folder:
        ranks = [context.Process(target=_bounce, args=(r, os.path.join(folder, "store"), kind,
                                                       trips, results)) for r in (0, 1)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(300)
            if process.is_alive():
                process.kill()
        if [p.exitcode for p in ranks] != [0, 0]:
            raise RuntimeError(f"{kind} ranks exited with {[p.exitcode for p in ranks]}")
    return dict(results.get() for _ in SIZES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few round trips per size")
    args = parser.parse_args()
    trips = dict(zip(SIZES, (10, 5, 2) if args.quick else (200, 50, 10)))
    measured = {kind: one_way(kind, trips) for kind in ("shm", "gloo")}
    print(f"{'one crossing, float32':<24}" + "".join(f"{name:>12}" for name in SIZES))
    for kind, times in measured.items():
        print(f"{kind:<24}" + "".join(f"{times[name] * 1e6:>10.0f}us" for name in SIZES))
    print(f"{'gloo / shm':<24}" + "".join(
        f"{measured['gloo'][n] / measured['shm'][n]:>11.2f}x" for n in SIZES))


if __name__ == "__main__":
    main()
