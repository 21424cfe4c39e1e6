#!/usr/bin/env bash
# Starts the broker on its embedded defaults, ready for sbctl: installs what the broker needs when
# it is missing (scripts/deps.sh broker), builds bin/broker, bin/sbctl and bin/sbx-init, and runs
# the broker in the foreground (Ctrl-C stops it). Extra arguments
# go to the broker (see bin/broker --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh broker
mkdir -p bin
# -buildvcs=auto: --version names the commit (where git can read the checkout).
go build -buildvcs=auto -o bin/ ./cmd/broker ./cmd/sbctl 2>/dev/null || go build -o bin/ ./cmd/broker ./cmd/sbctl
# The sandboxes' init runs inside templates' own root filesystems, which may have no libc: static.
CGO_ENABLED=0 go build -o bin/ ./cmd/sbx-init
echo "built bin/broker, bin/sbctl and bin/sbx-init; starting the broker (Ctrl-C to stop)" >&2
exec bin/broker "$@"
