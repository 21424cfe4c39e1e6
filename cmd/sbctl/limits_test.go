package main

import (
	"regexp"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
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

// sbctl limits shows what the org uses of max_sandboxes too (stopped sandboxes count), not only of
// max_running: a person near the limit sees it before a create is refused.
func TestLimitsShowSandboxesInUse(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	for _, name := range []string{"a", "b"} {
		if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.Client.StopSandbox(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	lim, err := b.Client.Limits(ctx)
	if err != nil || lim.Usage.Running != 1 || lim.Usage.Sandboxes != 2 {
		t.Fatalf("GET /v1/limits: %v %+v; want 1 running of 2 sandboxes", err, lim.Usage)
	}
	code, out, stderr := sbctlAt(t, b, "limits")
	if code != 0 || !regexp.MustCompile(`(?m)^max_sandboxes\s+\S+\s+2\s`).MatchString(out) || !regexp.MustCompile(`(?m)^max_running\s+\S+\s+1\s`).MatchString(out) {
		t.Fatalf("sbctl limits: exit %d %q %q; want max_sandboxes in use 2, max_running 1", code, out, stderr)
	}
}
