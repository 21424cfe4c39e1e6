#!/usr/bin/env bash
# Runs every test: installs what is missing, then the Go tests (unit, in-process server, end-to-end
# against the real binaries, real redis-server and real bubblewrap sandboxes).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# runsc for the gvisor isolation level's tests: built static from the Go module proxy at the version
# tools/runsc pins, cached under ~/.cache/sbx-broker (minutes the first time, nothing after).
scripts/runsc.sh >/dev/null
go vet ./...
# sbctl and the Go SDK build for every OS and CPU people run them on (the broker itself is Linux only).
for os in linux darwin windows; do
  for arch in amd64 arm64; do
    GOOS=$os GOARCH=$arch CGO_ENABLED=0 go build -o /dev/null ./cmd/sbctl ./client ./backend ./protocol ||
      { echo "sbctl or the SDK does not build for $os/$arch" >&2; exit 1; }
  done
done
# docs/openapi.yaml against the OpenAPI 3.0 schema with a standard validator (swagger-parser, pinned
# by scripts/openapi/package-lock.json); the Go tests check the server against the same file.
(cd scripts/openapi && npm ci --no-audit --no-fund --loglevel=error && npm run -s check)
# The MCP tests (tests/mcp_test.go) drive the broker with the official TypeScript MCP client.
(cd tests/mcp && npm ci --no-audit --no-fund)
# The Kubernetes binaries of the kubernetes provider's test cluster, built once and cached outside the
# repository (the first build takes 10-30 minutes on 2 cores, then nothing).
scripts/kube.sh build >/dev/null
go test -count=1 -timeout 20m ./...
(cd examples/langgraph-config && npm ci --no-audit --no-fund && npm test)
