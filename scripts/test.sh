#!/usr/bin/env bash
# Runs every test: installs what is missing, then the Go tests (unit, in-process server, end-to-end
# against the real binaries, real redis-server and real bubblewrap sandboxes).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
go vet ./...
# The MCP tests (tests/mcp_test.go) drive the broker with the official TypeScript MCP client.
(cd tests/mcp && npm ci --no-audit --no-fund)
go test -count=1 -timeout 20m ./...
(cd examples/langgraph-config && npm ci --no-audit --no-fund && npm test)
