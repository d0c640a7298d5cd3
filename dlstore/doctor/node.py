"""The node's own resources: the cache's disk, `/dev/shm`, and the CPU decode's native parts."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

from dlstore.cache import STATS_FILE_BYTES, cache_report
from dlstore.config import format_size
from dlstore.doctor.check import FAIL, OK, WARN, Check
from dlstore.errors import DlstoreError
from dlstore.format.manifest import Manifest

__all__ = ["LoaderShape", "cache_check", "decode_check", "shm_check"]

# flock is unreliable on these, and a cache shared by several nodes breaks its byte limit.
_NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p", "afs"}
_CACHE_FIX_DIR = "point DLSTORE_CACHE_DIR (or --cache-dir) at a node-local disk: NVMe scratch, /tmp, $SLURM_TMPDIR"


def _existing_ancestor(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def filesystem_type(path: str, mounts: str = "/proc/mounts") -> str | None:
    """The type of the file system holding `path`: that of the longest mount point above it."""
    try:
        with open(mounts) as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fstype = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, fields[2]
    return fstype


def _cached_bytes(cache_dir: str) -> int:
    """Bytes the cache already holds there; they count as room, since the cache evicts them."""
    try:
        return cache_report(cache_dir).bytes
    except (DlstoreError, OSError):
        return 0


def _write_refused(directory: str) -> str | None:
    """Why a file cannot be made in `directory`, or None; a test file is made and removed."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".dlstore-doctor-"):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def cache_check(cache_dir: str, limit_bytes: int, manifest: Manifest | None = None, num_nodes: int = 1) -> Check:
    """The directory is usable, on local disk, and has room for what the cache will hold.
    That is its limit, or this node's share of the dataset when that is smaller."""
    where = _existing_ancestor(cache_dir)
    made = "" if where == cache_dir else f" (to be made in {where})"
    if not os.access(where, os.W_OK | os.X_OK):
        return Check("cache", FAIL, f"{cache_dir}{made} is not writable by this user", _CACHE_FIX_DIR)
    refused = _write_refused(where)
    if refused:  # root passes `access` where the file system itself says no: /sys, a read-only mount
        return Check("cache", FAIL, f"{cache_dir}{made} cannot hold files: {refused}", _CACHE_FIX_DIR)
    fstype = filesystem_type(where)
    free = shutil.disk_usage(where).free
    room = free + (_cached_bytes(cache_dir) if where == cache_dir else 0)
    share = -(-manifest.total_size // max(num_nodes, 1)) if manifest is not None else None
    will_hold = min(limit_bytes, share + STATS_FILE_BYTES) if share is not None else limit_bytes
    seen = f"{cache_dir} ({fstype or 'unknown fs'}): limit {format_size(limit_bytes)}, {format_size(free)} free"
    biggest = max((s.size for s in manifest.shards), default=0) if manifest is not None else 0
    if biggest and limit_bytes - STATS_FILE_BYTES < biggest:
        return Check(
            "cache",
            FAIL,
            f"{seen}; the largest shard is {format_size(biggest)}: it does not fit",
            f"raise --cache-limit (the trainer's cache_limit) to several shards, e.g. {format_size(8 * biggest)}",
        )
    if room < will_hold:
        suggestion = format_size(max(int(room * 0.9), 0)).replace(" ", "")
        return Check(
            "cache",
            FAIL,
            f"{seen}: the cache may grow to {format_size(will_hold)} and fill the disk (NoSpace mid-run)",
            f"lower --cache-limit (the trainer's cache_limit) to {suggestion}, free space, or {_CACHE_FIX_DIR}",
        )
    if fstype in _NETWORK_FS or (fstype or "").startswith("fuse."):
        return Check("cache", WARN, f"{seen}; {fstype} is not a local disk", _CACHE_FIX_DIR)
    if fstype == "tmpfs":
        return Check("cache", WARN, f"{seen}; tmpfs holds the cache in RAM", f"if RAM is short, {_CACHE_FIX_DIR}")
    if share is not None and limit_bytes < share:
        return Check(
            "cache",
            WARN,
            f"{seen}; this node's share of the dataset is {format_size(share)}: epochs after the first read "
            f"{100 * (1 - limit_bytes / share):.0f}% of it from the store again",
            f"raise --cache-limit to {format_size(share + STATS_FILE_BYTES)} if the disk allows "
            f"({format_size(room)} available) to keep later epochs local",
        )
    return Check("cache", OK, seen)


@dataclass(frozen=True)
class LoaderShape:
    """What sizes the loader's shared memory: per rank, `slots` batches of uint8 HWC images.
    `ranks_per_node` ranks share `/dev/shm`."""

    batch_size: int
    image_size: int
    slots: int
    ranks_per_node: int = 1

    @property
    def shm_bytes(self) -> int:
        return self.ranks_per_node * self.slots * self.batch_size * self.image_size**2 * 3


def shm_check(shape: LoaderShape, shm_dir: str = "/dev/shm") -> Check:
    """`/dev/shm` holds the workers' batch slots, and torch's tensors handed between processes."""
    if not os.path.isdir(shm_dir):
        return Check("shm", WARN, f"{shm_dir} does not exist", "DataLoader workers need a shared-memory file system")
    usage = shutil.disk_usage(shm_dir)
    need = shape.shm_bytes
    how = (
        f"{shape.ranks_per_node} rank(s) x {shape.slots} slots x batch {shape.batch_size} x "
        f"{shape.image_size}² x 3 B = {format_size(need)}"
    )
    seen = f"{shm_dir}: {format_size(usage.free)} free of {format_size(usage.total)}; the loader takes {how}"
    size = f"{-(-int(need * 1.5) // 10**9)}g"
    fix = (
        f"give it more: `docker run --shm-size={size}`, on Kubernetes an emptyDir with medium: Memory and "
        f"sizeLimit: {size}; or fewer --workers / a smaller --batch-size"
    )
    if usage.free < need:
        return Check("shm", FAIL, seen, fix)
    if usage.free < 1.5 * need:
        return Check("shm", WARN, seen + " (little headroom for the DataLoader's own tensors)", fix)
    return Check("shm", OK, seen)


def decode_check(cpu_decode, headers_in_c: bool = True) -> Check:
    """Which native parts `cpu_decode`, the module or a stand-in, found, and so which path builds
    batches; `headers_in_c`, whether `dlstore.format.tar_headers` is built. Each one missing costs
    images per core; none breaks a run."""
    simplejpeg, cv2, region = cpu_decode.simplejpeg, cpu_decode.cv2, cpu_decode.jpeg_region
    if cpu_decode.torch_resizes_uint8():
        resizer = "torch's SIMD kernel"
    else:
        resizer = f"OpenCV {cv2.__version__}" if cv2 else "Pillow (no OpenCV)"
    rows = region is not None and hasattr(region, "crop_rows")
    parts = [
        f"JPEG decode: {f'simplejpeg {simplejpeg.__version__}' if simplejpeg else 'Pillow (no simplejpeg)'}",
        f"crop-only decode: {f'libjpeg-turbo {region.libjpeg_turbo_version}' if region else 'not built'}",
        f"batches: built by C threads that never take the GIL, resized in {region.resize_path().upper()}"
        if rows
        else "batches: image by image (decode threads wait for the GIL; GPU nodes use worker processes)",
        f"{'other transforms resize' if rows else 'resize'}: {resizer}",
        "tar headers: read in C" if headers_in_c else "tar headers: read in Python (the GIL held ~40 us a sample)",
    ]
    fixes = []
    if simplejpeg is None or cv2 is None:
        fixes.append('pip install -e ".[fast]" (simplejpeg, opencv-python-headless)')
    if not rows or not headers_in_c:
        fixes.append(
            "install a C compiler and libjpeg-turbo's headers (Debian/Ubuntu: apt-get install gcc libjpeg-dev), "
            "then pip install -e . again: a crop's rows and columns are then decoded alone, and C threads build "
            "the batches without the GIL"
        )
    return Check("decode", WARN if fixes else OK, "; ".join(parts), "; ".join(fixes))
