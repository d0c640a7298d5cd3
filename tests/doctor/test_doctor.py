"""`dlstore doctor`: each check on hand-made situations (environments, file systems, torch
facts), and the whole run against the local Swift server with good and bad settings."""

from __future__ import annotations

import logging
import os
import types
import uuid

import pytest

from dlstore.cli import main as cli_main
from dlstore.config import DataConfig, StoreConfig
from dlstore.convert import ConvertOptions, convert
from dlstore.demo.datagen import make_imagefolder
from dlstore.doctor import FAIL, OK, WARN, Check, DoctorOptions, exit_code, format_check, run_doctor
from dlstore.doctor.check import redact
from dlstore.doctor.credentials import credentials_check
from dlstore.doctor.gpu import TorchFacts, cuda_check, nccl_check, torch_check
from dlstore.doctor.launch import distributed_check
from dlstore.doctor.node import LoaderShape, cache_check, decode_check, filesystem_type, shm_check
from dlstore.format.checksums import checksum_of
from dlstore.format.manifest import Manifest, ShardInfo


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


# -- output -------------------------------------------------------------------------------------
def test_one_line_per_check_and_the_fix_below_warn_and_fail():
    assert format_check(Check("torch", OK, "torch 2.5", fix="unused")) == "ok    torch        torch 2.5"
    assert format_check(Check("shm", FAIL, "64 MB", fix="--shm-size=16g")).splitlines() == [
        "FAIL  shm          64 MB",
        "      fix: --shm-size=16g",
    ]
    assert exit_code([Check("a", OK, ""), Check("b", WARN, "")]) == 0
    assert exit_code([Check("a", OK, ""), Check("b", FAIL, "")]) == 1
    assert redact(Check("a", FAIL, "key hunter2 refused", "not hunter2"), ["hunter2"]) == Check(
        "a", FAIL, "key *** refused", "not ***"
    )
    with pytest.raises(ValueError):
        Check("a", "error", "")


def test_a_short_secret_is_blanked_where_it_stands_alone_not_inside_other_words():
    """With `ST_KEY=test`, `ST_USER=test:tester` read `***:***er`. A word that is the secret
    is still blanked (`ST_KEY=wrong` blanks "wrong" in any message): it might be the key."""
    check = Check("credentials", FAIL, "ST_USER=test:tester key='test' url=http://u:test@h", "the key is wrong")
    assert redact(check, ["test", "wrong"]) == Check(
        "credentials", FAIL, "ST_USER=***:tester key='***' url=http://u:***@h", "the key is ***"
    )
    long_secret = "s3cr3t-value-0123456789"  # blanked even inside a longer word
    assert redact(Check("a", FAIL, f"token=x{long_secret}y"), [long_secret]).summary == "token=x***y"


# -- credentials ----------------------------------------------------------------------------------
SECRET = "s3cr3t-value-" + uuid.uuid4().hex


def credentials(scheme: str | None, env: dict[str, str]) -> list[Check]:
    return credentials_check(scheme, env, StoreConfig.from_env(env))


def test_a_scheme_no_backend_reads_fails_the_credentials_check_instead_of_passing_it():
    """`doctor swfit://x/y` said "ok credentials swfit:// is fsspec's", then failed the store
    with "fix: see the credentials line above"."""
    [typo] = credentials("swfit", {})
    assert typo.status == FAIL and "no storage backend reads swfit:// URLs" in typo.summary
    [memory] = credentials("memory", {})
    assert memory.status == OK and "fsspec's" in memory.summary
    from dlstore.doctor.store_probe import probe_store

    [store] = probe_store("swfit://x/y", StoreConfig.from_env({}), 0).checks
    assert store.status == FAIL and "did you mean swift://" in store.summary and store.fix == "check the URL"


def test_swift_v1_credentials_name_the_variables_and_hide_the_key():
    env = {"ST_AUTH": "http://swift:8080/auth/v1.0", "ST_USER": "acct:me", "ST_KEY": SECRET}
    [check] = credentials("swift", env)
    assert check.status == OK
    assert "ST_AUTH=http://swift:8080/auth/v1.0" in check.summary and "ST_USER=acct:me" in check.summary
    assert "ST_KEY=***" in check.summary and SECRET not in format_check(check)

    [check] = credentials("swift", {"ST_AUTH": "http://swift:8080/auth/v1.0", "ST_USER": "acct:me"})
    assert check.status == FAIL and "ST_KEY" in check.summary

    [check] = credentials("swift", {**env, "OS_AUTH_URL": "https://keystone:5000/v3"})
    assert check.status == WARN and "ignored" in check.summary


def test_keystone_credentials():
    base = {"OS_AUTH_URL": "https://keystone:5000/v3", "OS_IDENTITY_API_VERSION": "3"}
    app = {**base, "OS_APPLICATION_CREDENTIAL_ID": "abc", "OS_APPLICATION_CREDENTIAL_SECRET": SECRET}
    [check] = credentials("swift", app)
    assert check.status == OK and "application credential" in check.summary and SECRET not in check.summary
    password = {**base, "OS_USERNAME": "me", "OS_PASSWORD": SECRET}
    [check] = credentials("swift", password)
    assert check.status == FAIL and "OS_PROJECT_NAME" in check.summary
    [check] = credentials("swift", {**password, "OS_PROJECT_NAME": "proj"})
    assert check.status == OK and "OS_PASSWORD=***" in check.summary and SECRET not in check.summary
    [check] = credentials("swift", {"OS_STORAGE_URL": "http://swift/v1/AUTH_x", "OS_AUTH_TOKEN": SECRET})
    assert check.status == WARN and "expires" in check.fix and SECRET not in format_check(check)
    [check] = credentials("swift", {})
    assert check.status == FAIL and "openrc" in check.fix


def test_s3_credentials():
    keys = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": "http://x"}
    [check] = credentials("s3", keys)
    assert check.status == OK and "AWS_ACCESS_KEY_ID=AKIAEXAMPLE" in check.summary and SECRET not in check.summary
    [check] = credentials("s3", {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE"})
    assert check.status == FAIL and "AWS_SECRET_ACCESS_KEY" in check.summary
    assert credentials("file", {})[0].status == OK
    # Without a URL: a line per backend whose variables are set, a warning when none is.
    assert [c.status for c in credentials(None, {})] == [WARN]
    assert [c.summary.split()[0] for c in credentials(None, {**keys, "ST_AUTH": "http://s/auth/v1.0"})] == [
        "Swift",
        "S3",
    ]


# -- distributed variables -------------------------------------------------------------------------
TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "x",
}


@pytest.mark.parametrize(
    "env, status, words",
    [
        ({}, OK, "single process"),
        (TORCHRUN, OK, "rank 5 of 8, local rank 1 of 4, node 1 of 2"),
        ({"RANK": "0"}, FAIL, "WORLD_SIZE is not"),
        ({**TORCHRUN, "RANK": "8"}, FAIL, "outside a world of 8"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "3"}, FAIL, "not a multiple"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, FAIL, "LOCAL_RANK=2"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, FAIL, "MASTER_ADDR is not set"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, FAIL, "not a port"),
        ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}, FAIL, "LOCAL_RANK=1"),
        (
            {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[1-2]"},
            FAIL,
            "SLURM_NTASKS_PER_NODE is not set",
        ),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "8",
                "SLURM_NTASKS_PER_NODE": "4(x2)",
                "SLURM_NNODES": "2",
                "SLURM_LOCALID": "1",
                "SLURM_JOB_NODELIST": "gpu[1-2]",
            },
            OK,
            "slurm: rank 5 of 8",
        ),  # fmt: skip
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "8",
                "SLURM_NTASKS_PER_NODE": "4(x2)",
                "SLURM_NNODES": "2",
                "SLURM_LOCALID": "2",
                "SLURM_JOB_NODELIST": "gpu[1-2]",
            },
            FAIL,
            "--distribution=block",
        ),  # fmt: skip
    ],
)
def test_distributed_variables(env, status, words):
    check = distributed_check(env)
    assert check.status == status, format_check(check)
    assert words in format_check(check)


def test_more_ranks_per_node_than_gpus_fails_one_gpu_per_task_is_fine():
    assert distributed_check(TORCHRUN, visible_gpus=2).status == FAIL
    assert distributed_check(TORCHRUN, visible_gpus=1).status == OK  # srun --gpus-per-task=1
    assert distributed_check(TORCHRUN, visible_gpus=4).status == OK


# -- torch, CUDA, NCCL -------------------------------------------------------------------------------
GOOD_GPU = TorchFacts(
    torch_version="2.5.1+cu124",
    torchvision_version="0.20.1+cu124",
    cuda_build="12.4",
    cuda_available=True,
    devices=("NVIDIA H100 80GB HBM3",) * 4,
    driver_cuda=(12, 6),
    dist_available=True,
    nccl_available=True,
    nccl_version="2.21.5",
)


def replace_facts(**changes) -> TorchFacts:
    return TorchFacts(**{**GOOD_GPU.__dict__, **changes})


def test_a_good_gpu_node():
    assert [c.status for c in (torch_check(GOOD_GPU), cuda_check(GOOD_GPU, {}), nccl_check(GOOD_GPU, 8))] == [OK] * 3
    assert "4 GPU(s) (NVIDIA H100 80GB HBM3); driver CUDA 12.6" in cuda_check(GOOD_GPU, {}).summary


@pytest.mark.parametrize(
    "facts, env, status, words",
    [
        (replace_facts(cuda_available=False, devices=(), cuda_build=None, torch_version="2.5.1+cpu"), {}, FAIL,
         "CPU-only"),
        (replace_facts(cuda_available=False, devices=(), driver_cuda=(11, 4)), {}, FAIL, "needs CUDA 12.4"),
        (replace_facts(driver_cuda=(12, 2)), {}, WARN, "minor-version"),
        (replace_facts(cuda_available=False, devices=()), {"CUDA_VISIBLE_DEVICES": ""}, FAIL, "hides every GPU"),
        (replace_facts(cuda_available=False, devices=(), cuda_error="CUDA driver initialization failed"), {}, FAIL,
         "initialization failed"),
        (replace_facts(cuda_available=False, devices=(), driver_cuda=None), {}, WARN, "runs on the CPU"),
    ],
)  # fmt: skip
def test_cuda_situations(facts, env, status, words):
    check = cuda_check(facts, env)
    assert check.status == status and words in format_check(check), format_check(check)


def test_torch_and_torchvision_situations():
    broken = torch_check(TorchFacts(torch_error="OSError: libcudnn.so.9: cannot open shared object file"))
    assert broken.status == FAIL and "libcudnn" in broken.summary
    assert cuda_check(TorchFacts(torch_error="x"), {}) is None and nccl_check(TorchFacts(torch_error="x"), 2) is None
    no_op = torch_check(replace_facts(torchvision_error="RuntimeError: operator torchvision::nms does not exist"))
    assert no_op.status == FAIL and "torchvision==0.20.*" in no_op.fix
    assert torch_check(replace_facts(torchvision_version="0.19.0+cu124")).status == WARN
    assert torch_check(replace_facts(torchvision_version="0.20.1+cu118")).status == WARN
    assert nccl_check(replace_facts(nccl_available=False), world_size=8).status == FAIL
    assert nccl_check(replace_facts(nccl_available=False), world_size=1).status == WARN
    assert nccl_check(replace_facts(cuda_available=False, devices=()), world_size=8).status == OK  # gloo


# -- cache and /dev/shm --------------------------------------------------------------------------------
def manifest_of(*sizes: int) -> Manifest:
    return Manifest(
        shards=tuple(ShardInfo(f"s-{i}.tar", size, 1, checksum_of(b"", "xxh3_128")) for i, size in enumerate(sizes))
    )


def test_cache_limits(tmp_path):
    cache = str(tmp_path / "cache")  # not there yet: its parent must be writable
    assert cache_check(cache, 10**9).status == OK
    too_big = cache_check(cache, 10**18)  # an exabyte: more than any disk here has free
    assert too_big.status == FAIL and "fill the disk" in too_big.summary and "--cache-limit" in too_big.fix
    below_a_shard = cache_check(cache, 5 * 10**6, manifest_of(10**7, 10**7))
    assert below_a_shard.status == FAIL and "largest shard" in below_a_shard.summary
    part = cache_check(cache, 3 * 10**7, manifest_of(*[10**7] * 10))
    assert part.status == WARN and "70%" in part.summary and "--cache-limit" in part.fix
    # A limit beyond the free space is fine when the dataset (this node's share) fits.
    assert cache_check(cache, 10**18, manifest_of(10**6), num_nodes=1).status == OK
    # A place that takes no files (root passes `access` there): said as such, not "lower the limit".
    nowhere = cache_check("/proc/dlstore-cache", 10**9)
    assert nowhere.status == FAIL and "cannot hold files" in nowhere.summary and "--cache-limit" not in nowhere.fix
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dlstore-doctor-")]  # its probe is gone


def test_filesystem_type_from_the_mount_table(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nserver:/home /home nfs4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n")
    assert filesystem_type("/home/me/.cache/dlstore", str(mounts)) == "nfs4"
    assert filesystem_type("/homework", str(mounts)) == "ext4"
    assert filesystem_type("/dev/shm", str(mounts)) == "tmpfs"


def test_shm(tmp_path):
    small = LoaderShape(batch_size=4, image_size=32, slots=18)
    assert small.shm_bytes == 18 * 4 * 32 * 32 * 3
    assert shm_check(small, str(tmp_path)).status == OK
    huge = LoaderShape(batch_size=10**6, image_size=4096, slots=18, ranks_per_node=8)
    check = shm_check(huge, str(tmp_path))
    assert check.status == FAIL and "--shm-size" in check.fix and "8 rank(s) x 18 slots" in check.summary
    assert shm_check(small, str(tmp_path / "absent")).status == WARN


def test_decode_names_the_native_parts_and_how_to_get_the_missing_ones():
    def parts(simplejpeg=True, cv2=True, region=True, torch_resize=False):
        return types.SimpleNamespace(
            simplejpeg=types.SimpleNamespace(__version__="1.9.0") if simplejpeg else None,
            cv2=types.SimpleNamespace(__version__="5.0.0") if cv2 else None,
            jpeg_region=types.SimpleNamespace(libjpeg_turbo_version="2.1.5", crop_rows=None, resize_path=lambda: "avx2")
            if region
            else None,
            torch_resizes_uint8=lambda: torch_resize,
        )

    check = decode_check(parts())
    assert check.status == OK and check.summary == (
        "JPEG decode: simplejpeg 1.9.0; crop-only decode: libjpeg-turbo 2.1.5; batches: built by C threads that "
        "never take the GIL, resized in AVX2; other transforms resize: OpenCV 5.0.0; tar headers: read in C"
    )
    check = decode_check(parts(), headers_in_c=False)
    assert check.status == WARN and "tar headers: read in Python" in check.summary and "C compiler" in check.fix
    assert "resize: torch's SIMD kernel" in decode_check(parts(torch_resize=True)).summary
    check = decode_check(parts(region=False))
    assert check.status == WARN and "crop-only decode: not built" in check.summary and "libjpeg-dev" in check.fix
    assert "batches: image by image" in check.summary and "worker processes" in check.summary
    assert "[fast]" not in check.fix
    check = decode_check(parts(simplejpeg=False, cv2=False))
    assert check.status == WARN and "Pillow (no simplejpeg)" in check.summary and "Pillow (no OpenCV)" in check.summary
    assert '".[fast]"' in check.fix and "libjpeg-dev" not in check.fix


def test_decode_reports_this_install():
    """The real module: this checkout's setup builds every part (tools/setup.sh installs libjpeg-dev)."""
    from dlstore.format import shards
    from dlstore.transforms import cpu_decode as transforms

    check = decode_check(transforms, shards.tar_headers is not None)
    assert check.status == OK, check


# -- the whole run against the local Swift server ------------------------------------------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("src"), num_classes=2, per_class=4).root


@pytest.fixture
def dataset(swift_server, swift_container, source):
    """A small dataset converted into a fresh container; its URL."""
    url = f"swift://{swift_container}/train"
    convert("imagefolder", source, url, ConvertOptions(workers=1), config=StoreConfig.from_env(swift_server.env()))
    return url


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """The process's environment without credentials or launcher variables, plus `extra`."""
    dropped = ("OS_", "ST_", "AWS_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(dropped)}, **extra}


def small_run(url: str, tmp_path, **changes) -> DoctorOptions:
    """Loader and cache sizes any test machine has room for."""
    settings = dict(cache_dir=str(tmp_path / "cache"), cache_limit=10**8, batch_size=2, workers=1, image_size=32)
    return DoctorOptions(DataConfig(url, **{**settings, **changes}))


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_good_settings_all_ok(swift_server, dataset, tmp_path, api):
    env = clean_env(swift_server.swift_env() if api == "swift" else swift_server.s3_env())
    url = dataset.replace("swift://", f"{api}://")
    checks = run_doctor(small_run(url, tmp_path), env)
    found = by_name(checks)
    for name in ("credentials", "endpoint", "auth", "listing", "manifest", "read", "cache", "shm", "torch"):
        assert found[name].status == OK, format_check(found[name])
    assert "8 samples in 1 shards" in found["manifest"].summary
    assert "MB/s" in found["read"].summary
    assert exit_code(checks) == 0, "\n".join(map(format_check, checks))


def test_cli_wrong_key_fails_auth_without_showing_it(swift_server, dataset, tmp_path, monkeypatch, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = f"wrong-key-{uuid.uuid4().hex}"
    for name in list(os.environ):
        if name not in clean_env({}):
            monkeypatch.delenv(name)
    for name, value in {**swift_server.swift_env(), "ST_KEY": wrong}.items():
        monkeypatch.setenv(name, value)
    args = ["doctor", dataset, "--cache-dir", str(tmp_path / "c"), "--cache-limit", "100MB", "--batch-size", "2"]
    assert cli_main(args) == 1
    out, err = capsys.readouterr()
    assert "FAIL  auth" in out and "401" in out and "ST_KEY=***" in out
    assert "listing" not in out  # nothing that depends on auth runs
    assert wrong not in out + err + caplog.text


def test_missing_container_is_named(swift_server, tmp_path):
    name = f"dlstore-absent-{uuid.uuid4().hex[:8]}"
    checks = run_doctor(small_run(f"swift://{name}/train", tmp_path), clean_env(swift_server.swift_env()))
    found = by_name(checks)
    assert found["auth"].status == OK
    assert found["listing"].status == FAIL and repr(name) in found["listing"].summary
    assert f"swift post {name}" in found["listing"].fix
    assert "manifest" not in found and exit_code(checks) == 1


def test_a_prefix_without_a_dataset_fails_on_the_manifest(swift_server, dataset, tmp_path):
    checks = run_doctor(small_run(dataset + "-not-here", tmp_path), clean_env(swift_server.swift_env()))
    found = by_name(checks)
    assert found["listing"].status == OK and found["manifest"].status == FAIL
    assert "dlstore convert" in found["manifest"].fix


def test_cache_limits_against_the_dataset(swift_server, dataset, tmp_path):
    env = clean_env(swift_server.swift_env())
    below_a_shard = by_name(run_doctor(small_run(dataset, tmp_path, cache_limit=2000), env))["cache"]
    assert below_a_shard.status == FAIL and "largest shard" in below_a_shard.summary
    beyond_the_disk = by_name(run_doctor(small_run(dataset, tmp_path, cache_limit=10**18), env))["cache"]
    assert beyond_the_disk.status == OK  # the dataset is small: the cache never grows past it
    no_url = run_doctor(
        DoctorOptions(DataConfig("", cache_dir=str(tmp_path / "c"), cache_limit=10**18, batch_size=2)), env
    )
    assert by_name(no_url)["cache"].status == FAIL and exit_code(no_url) == 1
