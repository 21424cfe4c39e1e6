package protocol

import (
	"bytes"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestExecDefaults(t *testing.T) {
	t.Parallel()
	if got := (ExecArgs{}).OutputCap(); got != ExecDefaultOutput {
		t.Errorf("cap of 0: %d, want %d", got, ExecDefaultOutput)
	}
	if got := (ExecArgs{MaxOutput: 10}).OutputCap(); got != 10 {
		t.Errorf("cap of 10: %d", got)
	}
	for _, tc := range []struct {
		ms   int64
		want time.Duration
	}{{0, time.Minute}, {500, 500 * time.Millisecond}, {int64(3 * time.Hour / time.Millisecond), time.Hour}} {
		if got := (ExecArgs{TimeoutMS: tc.ms}).Timeout(time.Minute, time.Hour); got != tc.want {
			t.Errorf("timeout_ms %d: %s, want %s", tc.ms, got, tc.want)
		}
	}
}

// One cap counts stdout and stderr together, drops (never blocks) past it, says so, and passes
// a writer's error back.
func TestExecOutputLimit(t *testing.T) {
	t.Parallel()
	l := NewExecOutputLimit(10)
	var out, errOut bytes.Buffer
	l.Deliver(&out, []byte("123456"))
	l.Deliver(&errOut, []byte("abcdef"))
	l.Deliver(&out, []byte("more"))
	if out.String() != "123456" || errOut.String() != "abcd" || !l.Truncated() {
		t.Errorf("stdout %q stderr %q truncated %v; want 123456, abcd, true", out.String(), errOut.String(), l.Truncated())
	}
	unlimited := &ExecOutputLimit{}
	var all bytes.Buffer
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); unlimited.Deliver(&all, bytes.Repeat([]byte("x"), 1000)) }()
	}
	wg.Wait()
	if all.Len() != 8000 || unlimited.Truncated() {
		t.Errorf("no cap: %d bytes, truncated %v", all.Len(), unlimited.Truncated())
	}
	boom := errors.New("boom")
	if err := NewExecOutputLimit(0).Deliver(failWriter{boom}, []byte("x")); err != boom {
		t.Errorf("writer error: %v", err)
	}
}

type failWriter struct{ err error }

func (w failWriter) Write([]byte) (int, error) { return 0, w.err }

func TestExecResultOutput(t *testing.T) {
	t.Parallel()
	var r ExecResult
	r.SetOutput(ExecArgs{Combined: true}, []byte("a\xffb"), nil)
	if r.Output == nil || *r.Output != "a\uFFFDb" || r.Stdout != nil || r.Stderr != nil {
		t.Errorf("combined: %+v", r)
	}
	r = ExecResult{}
	r.SetOutput(ExecArgs{}, []byte("out"), nil)
	if r.Output != nil || r.Stdout == nil || *r.Stdout != "out" || r.Stderr == nil || *r.Stderr != "" {
		t.Errorf("separate: %+v", r)
	}
	if !(ExecResult{Reason: ExecReasonCancelled}).Cancelled() || (ExecResult{Reason: ExecReasonTimeout}).Cancelled() {
		t.Error("Cancelled is the cancelled reason, and only that")
	}
}
