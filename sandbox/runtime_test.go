package sandbox

import (
	"errors"
	"fmt"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
)

// A provider's exec errors leave the sandbox package as protocol errors: the reason without the
// provider's prefix, a stopped sandbox as not_running; other causes stay internal.
func TestExecErrors(t *testing.T) {
	t.Parallel()
	disk := errors.New("disk on fire")
	cases := []struct {
		name    string
		err     error
		code    string // "" = passed through unchanged
		message string
	}{
		{"invalid request", fmt.Errorf("exec: %w", &provider.InvalidRequestError{Reason: "cwd /workspace/nope does not exist"}),
			protocol.CodeInvalidArgument, "cwd /workspace/nope does not exist"},
		{"stopped", fmt.Errorf("exec: %w", provider.ErrStopped), protocol.CodeNotRunning, "the sandbox stopped"},
		{"busy", fmt.Errorf("exec: %w", &provider.BusyError{Reason: "too many command streams open"}),
			protocol.CodeTooManyRequests, "too many command streams open"},
		{"anything else", disk, "", ""},
	}
	for _, tc := range cases {
		got := execError(tc.err)
		var pe *protocol.Error
		switch {
		case tc.code == "" && got != tc.err:
			t.Errorf("%s: %v, want it unchanged", tc.name, got)
		case tc.code != "" && (!errors.As(got, &pe) || pe.Code != tc.code || pe.Message != tc.message):
			t.Errorf("%s: %v, want %s %q", tc.name, got, tc.code, tc.message)
		}
	}
}
