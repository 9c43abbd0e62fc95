#!/usr/bin/env bash
# The engines' interpreter: SGLang (default sglang==0.5.23) with exactly its own pins, in a virtual
# environment of its own (SGLang pins transformers 5.19 and torch 2.14.1; the trainer needs 5.23).
#
#   launch/install_sglang.sh [VENV] [SPEC] [PYTHON]      (what `make install-sglang` runs)
#
# About 11 GB. The environment is built once per machine in a cache, $DSV4RL_SGLANG_CACHE (default
# ~/.cache/dsv4rl; an empty value builds VENV in place), and VENV becomes a link to it, so a fresh
# checkout on the same machine (CI's clone, a second worktree) reuses it. A cached copy is reused only
# when it finished installing (its stamp names SPEC) and its python imports that sglang release;
# anything else is removed and built again.
set -euo pipefail
venv=${1:-.venv-sglang}
spec=${2:-sglang==0.5.23}
python=${3:-python3}
version=${spec#*==}
stamp=.dsv4rl-installed

works() {  # $1: a venv; true when it holds a finished install of $spec that imports
    [ -f "$1/$stamp" ] && [ "$(cat "$1/$stamp")" = "$spec" ] && "$1/bin/python" - "$version" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
assert version("sglang") == sys.argv[1], version("sglang")
import sglang.srt.server_args  # noqa: F401  (the package and its pinned torch load)
PY
}

build() {  # $1: where; the stamp is written last, so an interrupted build is never reused
    rm -rf "$1"
    mkdir -p "$(dirname "$1")"
    "$python" -m venv "$1"
    "$1/bin/python" -m pip install --quiet --upgrade pip
    "$1/bin/python" -m pip install --quiet "$spec"
    echo "$spec" > "$1/$stamp"
    works "$1" || { echo "install_sglang: $spec installed in $1 but does not import" >&2; exit 1; }
}

started=$(date +%s)
if [ -e "$venv" ] && works "$venv"; then
    echo "install_sglang: $venv already holds $spec"
    exit 0
fi
if [ -n "${DSV4RL_SGLANG_CACHE-x}" ]; then
    tag=$("$python" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
    cache="${DSV4RL_SGLANG_CACHE:-$HOME/.cache/dsv4rl}/venv-sglang-$version-$tag"
    if works "$cache"; then
        echo "install_sglang: reusing $cache"
    else
        echo "install_sglang: building $cache ($spec, about 11 GB)"
        build "$cache"
    fi
    rm -rf "$venv"
    ln -s "$cache" "$venv"
else
    build "$venv"
fi
echo "install_sglang: $venv -> $spec ($(du -sh "$venv/" | cut -f1), $(($(date +%s) - started)) s)"
