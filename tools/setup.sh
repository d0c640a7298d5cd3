#!/usr/bin/env bash
# Install dlstore and what it needs into .venv, a virtual environment in this checkout, on a fresh
# Debian/Ubuntu machine with Python >= 3.10; then run it with .venv/bin/python (or source .venv/bin/activate).
#   bash tools/setup.sh          # the package, torch + torchvision, the trainer's extras
#   bash tools/setup.sh --test   # also the test tools, memcached, the local Swift server, Keystone and Slurm
# Always a venv, because Debian's and Ubuntu's own python3 refuse `pip install` (PEP 668). .venv is made
# from $PYTHON (default python3) and copies no torch that is already there:
#   - $PYTHON runs in a venv already (an activated one): .venv is a link to that venv;
#   - $PYTHON imports torch and torchvision (pyenv, conda): .venv sees its packages (--system-site-packages);
#   - otherwise (e.g. Debian's /usr/bin/python3): a plain .venv, and the pinned torch pair goes into it.
# An existing .venv is kept; delete it to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV_PYTHON=.venv/bin/python

# torch 2.14.1 + torchvision 0.29.1: the pair that imports together here (see README, "Two commands").
# Override with DLSTORE_TORCH_SPEC, e.g. "torch torchvision" to take the newest.
TORCH_SPEC=${DLSTORE_TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}

apt_install() {  # Debian packages not yet installed, as root or through sudo; `apt-get update` if one is unknown
    local missing=() sudo=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    if ! command -v apt-get >/dev/null; then
        echo "setup.sh: needs ${missing[*]} (or your system's equivalent) and there is no apt-get" >&2
        exit 1
    fi
    if [[ $(id -u) != 0 ]]; then
        sudo -n true 2>/dev/null || { echo "setup.sh: needs root: sudo apt-get install ${missing[*]}" >&2; exit 1; }
        sudo=(sudo -n)
    fi
    local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300)
    for p in "${missing[@]}"; do
        apt-cache show "$p" >/dev/null 2>&1 || { "${apt[@]}" update -qq; break; }
    done
    echo "setup.sh: apt-get install ${missing[*]}"
    "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}"
}

make_venv() {
    if [[ -x $VENV_PYTHON ]] && "$VENV_PYTHON" -c "" 2>/dev/null; then
        return  # made by an earlier run
    fi
    rm -rf .venv  # a venv whose interpreter is gone, or a link to a deleted venv (rm removes the link only)
    if "$PYTHON" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then
        ln -s "$("$PYTHON" -c "import sys; print(sys.prefix)")" .venv
        echo "setup.sh: .venv links to the active venv $(readlink .venv)"
        return
    fi
    local options=()
    if "$PYTHON" -c "import torch, torchvision" >/dev/null 2>&1; then
        options=(--system-site-packages)  # its torch, not a 5 GB copy
    fi
    echo "setup.sh: creating .venv from $PYTHON${options[*]:+ ${options[*]}}"
    if ! "$PYTHON" -m venv "${options[@]}" .venv; then
        # Debian and Ubuntu ship venv's ensurepip in a separate package.
        rm -rf .venv
        apt_install "python$("$PYTHON" -c "import sys; print('%d.%d' % sys.version_info[:2])")-venv"
        "$PYTHON" -m venv "${options[@]}" .venv
    fi
}

need_free_gb() {  # fail before pip does, halfway through a 5 GB install, with the folder and the figure
    local folder=$1 need=$2 free
    free=$(df -Pk "$folder" | awk 'NR == 2 {print int($4 / 1048576)}')
    if ((free < need)); then
        echo "setup.sh: $TORCH_SPEC needs about $need GB free in $folder (5.6 GB in the venv on x86_64, a CUDA build);" \
            "$free GB is free there. Free some space, or give PYTHON a python that imports torch" >&2
        exit 1
    fi
}

make_venv
if ! "$VENV_PYTHON" -c "import torch, torchvision" >/dev/null 2>&1; then
    need_free_gb "$(readlink -f .venv)" 7
    echo "setup.sh: pip install $TORCH_SPEC (a few GB, a few minutes)"
    # shellcheck disable=SC2086
    "$VENV_PYTHON" -m pip install --quiet $TORCH_SPEC
fi
# dlstore/transforms/jpeg_region.c (the crop-only JPEG decode) and dlstore/format/tar_headers.c need a C
# compiler, libjpeg-turbo's headers and Python's; without them the install goes on, whole JPEGs are decoded
# and tar headers read in Python (`dlstore doctor` says which).
native_build_deps() {
    local packages=(gcc libjpeg-dev)
    if ! "$VENV_PYTHON" -c "import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
        packages+=("python$("$VENV_PYTHON" -c "import sys; print('%d.%d' % sys.version_info[:2])")-dev")
    fi
    if ! (apt_install "${packages[@]}"); then
        echo "setup.sh: could not install ${packages[*]}: dlstore will decode whole JPEGs (slower); see dlstore doctor" >&2
    fi
}
native_build_deps
"$VENV_PYTHON" -m pip install --quiet -e ".[train,fast]"

if [[ "${1:-}" == "--test" ]]; then
    "$VENV_PYTHON" -m pip install --quiet -e ".[train,fast,test]"
    apt_install curl  # WebDataset's pipe:curl in the cold-read benchmark's peers (tests/integration/test_benchmarks.py)
    "$VENV_PYTHON" -m tests.support.swift_server install
    "$VENV_PYTHON" -m tests.support.swift_server install --flavor debian
    # A real Keystone in front of Debian's Swift (tests/integration/test_keystone.py): Debian's Keystone 22
    # and keystonemiddleware. A start and stop checks the install, in about 10 s.
    apt_install python3-keystone python3-keystonemiddleware
    ks_dir=$(mktemp -d -t dlstore-keystone-XXXXXX)
    if ! "$VENV_PYTHON" -m tests.support.keystone_server start --data-dir "$ks_dir" >/dev/null; then
        echo "setup.sh: the local Keystone does not start; see the logs above" >&2
        rm -rf "$ks_dir"
        exit 1
    fi
    "$VENV_PYTHON" -m tests.support.keystone_server stop --data-dir "$ks_dir"
    rm -rf "$ks_dir"
    "$VENV_PYTHON" -m tests.support.slurm_server install  # Debian's slurmctld, slurmd, slurm-client, munge
fi
echo "setup.sh: done; run dlstore with $VENV_PYTHON -m dlstore (or: source .venv/bin/activate)"
