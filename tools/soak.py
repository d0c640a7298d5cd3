#!/usr/bin/env python3
"""A longer soak than CI runs: many epochs on several gloo ranks through the fault proxy,
with the Swift server stopped and started again now and then; then the keys each rank
delivered are compared with a fault-free pass over the same plan.

It starts its own Swift server (in a temp dir, on free loopback ports), so nothing else is
disturbed, and stops it at the end. Exit status 0 when every epoch delivered exactly the
fault-free keys, 1 otherwise.

    python tools/soak.py --epochs 20 --rate 0.1 --outage-every 60 --outage-s 20
    python tools/soak.py --api s3 --ranks 4 --workers 2 --epochs 50
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import swiftclient
import torch.multiprocessing as torch_mp
from fault_proxy import ALL_FAULTS, FaultProxy
from loader_support import fault_free_run, run_rank, write_dataset
from swift_server import read_env_file

import dlstore
from dlstore.config import StoreConfig

REPO = Path(__file__).resolve().parents[1]

SERVER = [sys.executable, str(REPO / "tools" / "swift_server.py")]


def _tool(*args: str) -> None:
    result = subprocess.run([*SERVER, *args], capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        raise SystemExit(f"soak: swift_server.py {args[0]} failed:\n{result.stderr[-3000:]}")


def _outages(data_dir: Path, port: str, every: float, length: float, stop: threading.Event, log: list) -> None:
    while not stop.wait(every):
        _tool("stop", "--data-dir", str(data_dir))
        started = time.monotonic()
        stop.wait(length)
        _tool("start", "--data-dir", str(data_dir), "--port", port)
        log.append(time.monotonic() - started)
        print(f"soak: server was down {log[-1]:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", choices=["swift", "s3"], default="swift")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--rate", type=float, default=0.1, help="fraction of GETs faulted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--outage-every", type=float, default=0, help="seconds between server stops (0: none)")
    parser.add_argument("--outage-s", type=float, default=20, help="how long each stop lasts")
    parser.add_argument("--deadline-s", type=float, default=120, help="the loader's retry deadline")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="dlstore-soak-"))
    data_dir = work / "swift"
    _tool("start", "--data-dir", str(data_dir), "--stop-with-pid", str(os.getpid()))
    server = read_env_file(data_dir / "env.sh")
    port = str(urlsplit(server["ST_AUTH"]).port)
    try:
        direct = (
            {k: server[k] for k in ("ST_AUTH", "ST_USER", "ST_KEY")}
            if args.api == "swift"
            else {k: v for k, v in server.items() if k.startswith("AWS_")}
        )
        swiftclient.Connection(authurl=server["ST_AUTH"], user=server["ST_USER"], key=server["ST_KEY"]).put_container(
            "soak"
        )
        url = f"{args.api}://soak/data"
        store = dlstore.open_store(url, StoreConfig.from_env(direct))
        sizes = [2 + (i * 7) % 5 for i in range(args.shards)]
        write_dataset(store, sizes)
        largest = max(i.size for i in store.list() if i.key.endswith(".tar"))
        spec = dict(
            url=url,
            cache_limit=4 * largest + 4096,
            batch_size=4,
            seed=args.seed,
            world_size=args.ranks,
            local_world_size=args.ranks,
            workers=args.workers,
            epochs=args.epochs,
            out=str(work),
        )
        print(f"soak: {sum(sizes)} samples in {args.shards} shards; fault-free pass first", flush=True)
        expected = fault_free_run(url, spec, str(work / "cache-reference"), StoreConfig.from_env(direct))

        with FaultProxy(int(port), seed=args.seed) as proxy:
            proxy.set_rate(args.rate, kinds=ALL_FAULTS, method="GET")
            env = {
                **direct,
                **({"ST_AUTH": f"{proxy.url}/auth/v1.0"} if args.api == "swift" else {"AWS_ENDPOINT_URL": proxy.url}),
                "DLSTORE_RETRY_DEADLINE": str(args.deadline_s),
                "DLSTORE_RETRY_BACKOFF": "0.1",
                "DLSTORE_READ_TIMEOUT": "2",
            }
            spec.update(env=env, cache_dir=str(work / "cache"), init=f"file://{work}/rdv")
            stop, downs = threading.Event(), []
            outages = None
            if args.outage_every > 0:
                outages = threading.Thread(
                    target=_outages, args=(data_dir, port, args.outage_every, args.outage_s, stop, downs), daemon=True
                )
                outages.start()
            started = time.monotonic()
            proxy.stall_s = 4.0
            torch_mp.start_processes(run_rank, args=(spec,), nprocs=args.ranks, start_method="spawn")
            took = time.monotonic() - started
            stop.set()
            if outages is not None:
                outages.join()
            faults = proxy.injected_kinds()
            gets = proxy.count("GET")

        bad = 0
        for rank in range(args.ranks):
            record = json.loads((work / f"rank-{rank}.json").read_text())
            for epoch, batches in record["epochs"].items():
                if batches != expected[rank][epoch]:
                    bad += 1
                    print(f"soak: rank {rank} epoch {epoch} differs from the fault-free pass", flush=True)
        counts = collections.Counter(
            k
            for rank in range(args.ranks)
            for batch in json.loads((work / f"rank-{rank}.json").read_text())["epochs"]["0"]
            for k, padding in batch
            if not padding
        )
        print(
            f"soak: {args.epochs} epochs x {args.ranks} ranks in {took:.0f} s; {gets} GETs, faults {dict(faults)}, "
            f"{len(downs)} outages; epochs differing from the fault-free pass: {bad}; "
            f"epoch 0 delivered {len(counts)} distinct keys of {sum(sizes)}",
            flush=True,
        )
        return 1 if bad else 0
    finally:
        _tool("stop", "--data-dir", str(data_dir))


if __name__ == "__main__":
    sys.exit(main())
