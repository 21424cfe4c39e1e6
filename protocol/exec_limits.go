package protocol

import (
	"io"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

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

// What follows is the one implementation of exec's semantics beyond the limits, shared by the
// broker's dataplane and the backend's Local: the output cap's default, how a cap truncates output
// across stdout and stderr, how output becomes text in a result, and what a cancelled command is.

// Reasons a command was ended by the broker or the kernel (ExecResult.Reason).
const (
	ExecReasonTimeout     = "timeout"
	ExecReasonCancelled   = "cancelled"
	ExecReasonMemoryLimit = "memory_limit"
)

// OutputCap is the request's output cap: MaxOutput, or ExecDefaultOutput when it is 0.
func (a ExecArgs) OutputCap() int64 {
	if a.MaxOutput == 0 {
		return ExecDefaultOutput
	}
	return a.MaxOutput
}

// Timeout is the request's timeout: TimeoutMS, or def when it is 0, and never more than max.
func (a ExecArgs) Timeout(def, max time.Duration) time.Duration {
	t := def
	if a.TimeoutMS > 0 {
		t = time.Duration(a.TimeoutMS) * time.Millisecond
	}
	return min(t, max)
}

// ExecOutputLimit applies one output cap across a command's outputs (stdout and stderr count
// together) and serializes writes to them (they may be one writer). Past the cap, output is dropped,
// never blocked on, and Truncated says so. The zero value has no cap.
type ExecOutputLimit struct {
	mu        sync.Mutex
	max, n    int64
	truncated bool
}

// NewExecOutputLimit caps output at max bytes (0: no cap).
func NewExecOutputLimit(max int64) *ExecOutputLimit { return &ExecOutputLimit{max: max} }

// Deliver writes what of p the cap leaves room for to w and returns w's error, if any.
func (l *ExecOutputLimit) Deliver(w io.Writer, p []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.max > 0 {
		room := l.max - l.n
		if room < int64(len(p)) {
			l.truncated = true
			if room <= 0 {
				return nil
			}
			p = p[:room]
		}
	}
	l.n += int64(len(p))
	if len(p) == 0 {
		return nil
	}
	_, err := w.Write(p)
	return err
}

// Truncated says output was dropped at the cap.
func (l *ExecOutputLimit) Truncated() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.truncated
}

// SetOutput puts a non-streamed command's output into the result, as Output (Combined) or Stdout
// and Stderr. Output is text: invalid UTF-8 becomes U+FFFD (stream to get exact bytes).
func (r *ExecResult) SetOutput(a ExecArgs, stdout, stderr []byte) {
	if a.Combined {
		r.Output = execText(stdout)
		return
	}
	r.Stdout, r.Stderr = execText(stdout), execText(stderr)
}

func execText(b []byte) *string {
	s := string(b)
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	return &s
}

// Cancelled says the command was ended because its request was cancelled: such a command has no
// result, and the request ends with code cancelled.
func (r ExecResult) Cancelled() bool { return r.Reason == ExecReasonCancelled }
