"""WebDataset streaming the same shards from the same Swift, for `bench_cold.py loader
--peers`: the peer's usual remote pipeline (`pipe:curl` per shard, shard shuffle, a sample
shuffle buffer, the same decode + RandomResizedCrop + flip as `bench_peers`), through the
same setting (loopback, or the WAN emulator). It has no cache, so each of its epochs is cold:
the figure a user compares dlstore's cold epoch with.

The token goes to curl in a header file (mode 0600), not on its command line, which
WebDataset may quote in an error.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

import bench_peers
import swiftclient
import webdataset as wds
from bench_loader import spread


@dataclass
class PeerEpoch:
    """One epoch of a fresh WebDataset loader, from `iter()`."""

    images_per_s: float
    first_batch_s: float
    seconds: float


def curl_urls(env: Mapping[str, str], container: str, prefix: str, header_dir: str) -> list[str]:
    """`pipe:curl` URLs of the shards under `prefix` in `container`, reached the way `env`'s
    credentials reach Swift (through the emulator, tempauth hands out its URL)."""
    storage_url, token = swiftclient.get_auth(env["ST_AUTH"], env["ST_USER"], env["ST_KEY"])
    fd, header = tempfile.mkstemp(prefix="auth-header-", dir=header_dir)  # mode 0600
    with os.fdopen(fd, "w") as file:
        file.write(f"X-Auth-Token: {token}\n")
    connection = swiftclient.Connection(preauthurl=storage_url, preauthtoken=token)
    _, objects = connection.get_container(container, prefix=prefix, full_listing=True)
    names = sorted(o["name"] for o in objects if o["name"].endswith(".tar"))
    if not names:
        raise SystemExit(f"no shards under {container}/{prefix} in Swift")
    return [f"pipe:curl -sSf -H @{header} {storage_url}/{container}/{quote(name)}" for name in names]


def webdataset_epoch(urls: list[str], decode: str, args: argparse.Namespace) -> PeerEpoch:
    """One epoch of a fresh `wds.WebLoader` over `urls` with `args.workers` workers."""
    loader = wds.WebLoader(
        bench_peers.webdataset_pipeline(urls, decode, args),
        batch_size=None,
        num_workers=args.workers,
        timeout=args.batch_timeout if args.workers > 0 else 0,  # a stalled curl ends the run
    )
    images, first = 0, None
    started = time.perf_counter()
    for batch in loader:
        if first is None:
            first = time.perf_counter() - started
        images += batch[0].shape[0]
    seconds = time.perf_counter() - started
    return PeerEpoch(images / seconds, first or 0.0, seconds)


def summarize(rounds: list[dict], peer: str) -> dict:
    """Per setting: WebDataset streaming (`rounds`' entries under (setting, `peer`)), and
    each dlstore variant's cold epoch (its (warm, cold) pair) against it, round by round."""
    out: dict = {}
    for setting, variant in rounds[0]:
        if variant != peer:
            continue
        peers = [r[(setting, peer)] for r in rounds]
        out[setting] = {
            "webdataset_img_s": spread([p.images_per_s for p in peers]),
            "webdataset_first_batch_s": spread([p.first_batch_s for p in peers]),
            "dlstore_cold_over_webdataset": {
                v: spread([r[(s, v)][1].images_per_s / r[(s, peer)].images_per_s for r in rounds])
                for s, v in rounds[0]
                if s == setting and v != peer
            },
        }
    return out


def print_report(peers: dict) -> None:
    print("WebDataset streaming the same shards from the same Swift (pipe:curl, no cache: every epoch cold)")
    for setting, res in peers.items():
        img, first = res["webdataset_img_s"], res["webdataset_first_batch_s"]
        ratios = "  ".join(
            f"dlstore cold ({v}) / webdataset {r['median']:.2f} [{r['min']:.2f} .. {r['max']:.2f}]"
            for v, r in res["dlstore_cold_over_webdataset"].items()
        )
        print(
            f"  {setting:<18} {img['median']:7.0f} img/s [{img['min']:.0f} .. {img['max']:.0f}]"
            f"  first batch {first['median']:.2f} s   {ratios}"
        )
