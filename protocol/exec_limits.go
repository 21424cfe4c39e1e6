package protocol

import "time"

// Exec limits every implementation of the exec operation applies the same way: the broker's
// dataplane and the backend's Local (CLI mode). A template may change a sandbox's timeouts; these
// are the defaults.
const (
	// ExecDefaultTimeout kills a command's process tree when ExecArgs.TimeoutMS is 0.
	ExecDefaultTimeout = 10 * time.Minute
	// ExecMaxTimeout caps ExecArgs.TimeoutMS.
	ExecMaxTimeout = time.Hour
	// ExecDefaultOutput is the output cap when ExecArgs.MaxOutput is 0.
	ExecDefaultOutput int64 = 1 << 20
	// ExecMaxAnswerOutput is the largest MaxOutput of a non-streamed exec: its output travels in one
	// JSON answer, which the broker holds in memory. Stream to get more.
	ExecMaxAnswerOutput int64 = 8 << 20
	// ExecMaxStreamOutput is the largest MaxOutput of a streamed exec (Limits.MaxOutputBytes).
	ExecMaxStreamOutput int64 = 64 << 20
)

// ValidateExec checks the parts of an exec request that do not depend on where it runs: exactly
// one of Command and Argv, no negative timeout or output cap, and MaxOutput within
// ExecMaxAnswerOutput (ExecMaxStreamOutput with Stream). It does not check Cwd (a sandbox path,
// resolved by the workspace) or a token's command allowlist.
func ValidateExec(a ExecArgs) error {
	if (a.Command == "") == (len(a.Argv) == 0) {
		return Errorf(CodeInvalidArgument, "exec needs exactly one of command (a shell string) or argv")
	}
	if a.TimeoutMS < 0 || a.MaxOutput < 0 {
		return Errorf(CodeInvalidArgument, "timeout_ms and max_output must not be negative")
	}
	if a.MaxOutput > ExecMaxStreamOutput || (!a.Stream && a.MaxOutput > ExecMaxAnswerOutput) {
		return Errorf(CodeInvalidArgument, "max_output is at most %d bytes, or %d with stream: true", ExecMaxAnswerOutput, ExecMaxStreamOutput)
	}
	return nil
}
