package main

import (
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// Every refusal by a limit exits 7, so a script can tell "wait or ask for more" from a failure.
func TestLimitedExit7(t *testing.T) {
	t.Parallel()
	for _, c := range []string{protocol.CodeQuotaExceeded, protocol.CodeRateLimited, protocol.CodeTooManyConnections} {
		if got := exitCodeOf(&protocol.Error{Code: c, Status: 429}); got != exitLimited {
			t.Errorf("%s: exit %d, want %d", c, got, exitLimited)
		}
	}
}
