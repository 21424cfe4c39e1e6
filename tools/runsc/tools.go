//go:build tools

// Package tools pins gvisor.dev/gvisor/runsc at the version in go.mod; scripts/runsc.sh builds it.
package tools

import _ "gvisor.dev/gvisor/runsc"
