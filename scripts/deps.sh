#!/usr/bin/env bash
# Installs what the broker and its tests need when it is missing: redis-server (the embedded Redis
# and the tests' real Redis) and bubblewrap (the namespace sandbox provider), from Debian packages.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "missing: ${missing[*]}; install them as root: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi
echo "installing ${missing[*]} (Debian packages)..." >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
  $sudo apt-get update -q >/dev/null
  $sudo apt-get install -y -q "${missing[@]}" >/dev/null
}
# The redis-server package may start a system Redis on 6379; the broker does not use it.
