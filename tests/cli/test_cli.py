"""`dlstore ls` / `dlstore cp` on local stores, and the URL registry."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlstore.cli import build_parser, main
from dlstore.errors import ConfigError
from dlstore.storage import open_store, split_object_url
from dlstore.world import World


def test_cp_round_trip_between_local_stores(tmp_path, capsys):
    src = tmp_path / "src.bin"
    payload = bytes(range(256)) * 5000
    src.write_bytes(payload)
    assert main(["cp", "-q", str(src), f"file://{tmp_path}/store/a/copy.bin"]) == 0
    assert main(["cp", "-q", f"file://{tmp_path}/store/a/copy.bin", f"{tmp_path}/back/"]) == 0
    assert (tmp_path / "back" / "copy.bin").read_bytes() == payload
    assert main(["ls", "--long", f"file://{tmp_path}/store"]) == 0
    out = capsys.readouterr()
    assert f"{len(payload):>14}  a/copy.bin" in out.out
    assert "1 object, " in out.err
    # The URL of an object lists that object (it said "no objects under ...").
    assert main(["ls", "--long", f"file://{tmp_path}/store/a/copy.bin"]) == 0
    out = capsys.readouterr()
    assert f"{len(payload):>14}  copy.bin" in out.out and "1 object, " in out.err
    assert main(["ls", f"file://{tmp_path}/store/a/nothing.bin"]) == 0
    assert "no objects under" in capsys.readouterr().err


def test_a_progress_bar_goes_only_to_a_terminal(tmp_path):
    """`dlstore cp ... 2> log` (or convert, verify, index, train under a batch system) wrote
    the progress bar's carriage-return updates into the log. A stderr that is no terminal
    gets no bar; what is logged still reaches it."""
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 5000)
    command = [sys.executable, "-m", "dlstore", "cp", str(src), f"file://{tmp_path}/store/copy.bin"]
    done = subprocess.run(command, capture_output=True, timeout=120)
    assert done.returncode == 0 and (tmp_path / "store" / "copy.bin").stat().st_size == 256 * 5000
    assert b"\r" not in done.stderr and b"copy" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_cp_to_a_local_folder_without_a_slash_copies_into_it(tmp_path, scheme):
    """As `cp` does. It downloaded the whole object, then failed on "Is a directory"."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 5000)
    (tmp_path / "into").mkdir()
    assert main(["cp", "-q", str(src), f"{scheme}{tmp_path}/into"]) == 0
    assert (tmp_path / "into" / "src.bin").read_bytes() == b"x" * 5000


def test_cp_of_a_missing_object_is_a_clear_error(tmp_path, capsys):
    assert main(["cp", "-q", f"{tmp_path}/nope.bin", f"{tmp_path}/out.bin"]) == 2
    assert "NotFound" in capsys.readouterr().err
    assert not (tmp_path / "out.bin").exists()


def test_ls_with_prefix_streams_keys_in_order(tmp_path, capsys):
    store = open_store(str(tmp_path))
    for key in ["b/2", "a/1", "a/10", "a/2", "ab"]:
        store.put(key, b"x")
    assert main(["ls", str(tmp_path), "a"]) == 0
    assert capsys.readouterr().out.split() == ["a/1", "a/10", "a/2", "ab"]


def test_ls_of_nothing_says_so(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "missing")]) == 0
    assert capsys.readouterr().err.strip() == f"no objects under file://{tmp_path}/missing"
    assert main(["ls", str(tmp_path), "shard-"]) == 0
    assert "(keys starting 'shard-')" in capsys.readouterr().err


def test_split_object_url():
    assert split_object_url("s3://bucket/a/b.tar") == ("s3://bucket/a", "b.tar")
    assert split_object_url("file:///x/y") == ("file:///x", "y")
    with pytest.raises(ConfigError):
        split_object_url("swift://container")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, World(0, 1, 1)),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, World(3, 8, 4)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)"}, World(5, 8, 4)),
    ],
)
def test_world_from_env(env, expected):
    assert World.from_env(env) == expected


SRUN_STEP = {  # what srun -N2 -n4 gives its fourth task (no --ntasks-per-node: no SLURM_NTASKS_PER_NODE)
    "SLURM_JOB_ID": "7",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def test_a_slurm_step_is_read_from_its_own_variables():
    """The step's tasks per node, not the job's (absent without --ntasks-per-node: every task
    was taken for node 0's, and each node fetched the whole dataset); an `srun -n 1` in a job of
    2 tasks per node is one process (it was refused); a batch script itself, with its job's
    variables but no step's, is one process (it was rank 0 of the job's tasks, and training
    waited 30 minutes for the others); uneven layouts and another task numbering are refused."""
    world = World.from_env(SRUN_STEP)
    assert (world.rank, world.world_size, world.node, world.local_rank, world.num_nodes) == (3, 4, 1, 1, 2)
    job_of_two = {"SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_ID": "8"}
    one = {**job_of_two, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    assert World.from_env({**one, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}) == World(0, 1, 1)
    batch_script = {**job_of_two, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    assert World.from_env(batch_script) == World()
    with pytest.raises(ConfigError, match="tasks per node differ"):
        World.from_env(
            {**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "3", "SLURM_PROCID": "2", "SLURM_STEP_TASKS_PER_NODE": "2,1"}
        )
    with pytest.raises(ConfigError, match="distribution=block"):
        World.from_env({**SRUN_STEP, "SLURM_LOCALID": "0"})


def test_world_rejects_inconsistent_sizes():
    with pytest.raises(ConfigError):
        World(rank=0, world_size=6, local_world_size=4)
    with pytest.raises(ConfigError):
        World.from_env({"RANK": "9", "WORLD_SIZE": "4"})


def test_every_flag_the_docs_show_for_a_command_is_one_of_its_flags():
    """The command list in docs/cli.md (it named `convert --image-format`, a flag that never existed)."""
    readme = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    block = readme[readme.index("\ndlstore ls URL") : readme.index("\n```", readme.index("\ndlstore ls URL"))]
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    shown: dict[str, set[str]] = {}
    command = ""
    for line in block.splitlines():
        words = line.split()
        if words and words[0] == "dlstore":
            command = words[1]
            # `cache stats`: the flags belong to the sub-subcommand
            if command == "cache":
                command = f"cache {words[2]}"
        if not command:
            continue
        shown.setdefault(command, set()).update(re.findall(r"\[(--[a-z][a-z-]*)", line))
        shown[command].update(re.findall(r" (--[a-z][a-z-]*)[ \]]", line.split("  ")[0]))
    for command, flags in shown.items():
        sub = commands[command.split()[0]]
        if " " in command:
            sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[command.split()[1]]
        known = {option for action in sub._actions for option in action.option_strings}
        assert flags <= known, (command, flags - known)
    assert {"convert", "train", "bench", "cache stats"} <= set(shown) and "--format" in shown["convert"]


def test_the_cli_starts_without_importing_torch():
    """`dlstore ls`, `cp`, `cache stats` and `--help` need no torch: importing it took ~2 s of
    every command (the parsers read the loader's settings, whose package imported the loader)."""
    code = "import sys, dlstore.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_verbose_goes_before_or_after_the_subcommand():
    """`dlstore ls -v URL` was an "unrecognized arguments" error; only `dlstore -v ls URL` worked."""
    from dlstore.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["ls", "-v", "x"]).verbose == 1
    assert parser.parse_args(["-vv", "ls", "x"]).verbose == 2
    assert parser.parse_args(["ls", "x"]).verbose == 0
    assert parser.parse_args(["cache", "stats", "-vv", "d"]).verbose == 2


def test_names_from_a_manifest_cannot_drive_the_terminal(tmp_path, capsys):
    """Class names, the source and shard names are anyone's: printed raw by `ls` and `verify`,
    ESC[2J cleared the screen and a shard named with CR LF forged an "OK" line in verify."""
    from dlstore.cli import main
    from dlstore.format.manifest import Manifest
    from tests.support.loader_support import write_dataset

    url = f"file://{tmp_path}/data"
    store = open_store(url)
    write_dataset(store, [3])
    manifest = Manifest.load(store)
    forged = "x\r\nOK: 2 shards, 36 samples\x1b[8m"
    shards = (dataclasses.replace(manifest.shards[0], name=forged),)
    dataclasses.replace(manifest, shards=shards, classes=("\x1b[2Jcat", *manifest.classes[1:])).save(store)
    assert main(["ls", url]) == 0
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and not any(line.startswith("OK") for line in out.splitlines())
    assert "\\x1b[2Jcat" in out and "x\\r\\nOK" in out


def test_convert_format_is_refused_where_it_would_be_ignored_and_sizes_read_as_sizes(tmp_path, capsys):
    """`--format jpeg` on an ImageFolder was accepted and ignored; `train --help` showed the cache
    limit's default as 50000000000."""
    from dlstore.cli import build_parser, main

    (tmp_path / "src" / "a").mkdir(parents=True)
    assert main(["convert", "imagefolder", str(tmp_path / "src"), f"file://{tmp_path}/out", "--format", "jpeg"]) != 0
    assert "--format is for cifar10 and mnist" in capsys.readouterr().err
    usage = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "(default: 50.0 GB)" in " ".join(usage.split()) and "50000000000" not in usage
