package wait_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/tests/wait"
)

// fakeT records a failure instead of ending the test.
type fakeT struct {
	testing.TB
	failed string
}

func (f *fakeT) Helper() {}
func (f *fakeT) Fatalf(format string, args ...any) {
	f.failed = format
}

func TestUntilAndFor(t *testing.T) {
	var n atomic.Int32
	if !wait.Until(5*time.Second, func() bool { return n.Add(1) == 3 }) {
		t.Fatal("a condition true at the third check was not seen")
	}
	if wait.Until(30*time.Millisecond, func() bool { return false }) {
		t.Fatal("a condition never true was reported true")
	}
	boom := errors.New("boom")
	if err := wait.For(30*time.Millisecond, func() error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("For answered %v, want the last error", err)
	}
	n.Store(0)
	if err := wait.For(5*time.Second, func() error {
		if n.Add(1) < 3 {
			return boom
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

func TestEventuallyAndNever(t *testing.T) {
	f := &fakeT{}
	wait.Eventually(f, 20*time.Millisecond, func() bool { return false }, "x")
	if f.failed == "" {
		t.Fatal("Eventually of a false condition did not fail")
	}
	f = &fakeT{}
	wait.Eventually(f, time.Second, func() bool { return true }, "x")
	if f.failed != "" {
		t.Fatal("Eventually of a true condition failed")
	}
	var n atomic.Int32
	f = &fakeT{}
	wait.Never(f, 5*time.Second, func() bool { return n.Add(1) == 2 }, "x")
	if f.failed == "" {
		t.Fatal("Never missed a condition that became true")
	}
	f = &fakeT{}
	start := time.Now()
	wait.Never(f, 30*time.Millisecond, func() bool { return false }, "x")
	if f.failed != "" || time.Since(start) < 30*time.Millisecond {
		t.Fatalf("Never of a false condition: failed %q after %s", f.failed, time.Since(start))
	}
}
