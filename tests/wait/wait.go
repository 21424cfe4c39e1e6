// Package wait is how tests wait: on a condition with a deadline, never on a fixed sleep. A test
// that sleeps "long enough" is slow on a fast machine and flaky on a loaded one; a test that polls
// a condition is as fast as the system and fails only when the condition never holds.
//
// Never is the other half: that something does NOT happen. It can only be as good as the moment
// it starts, so call it after a signal that whatever would cause it has been processed (a flush
// barrier, an answer, a later event), and use it for the short remainder.
package wait

import (
	"fmt"
	"testing"
	"time"
)

// poll is the first interval between checks; it doubles up to maxPoll.
const (
	poll    = 5 * time.Millisecond
	maxPoll = 100 * time.Millisecond
)

// Until polls cond until it is true (answering true) or limit has passed (answering false, after
// one last check).
func Until(limit time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(limit)
	for d := poll; ; d = min(2*d, maxPoll) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return cond()
		}
		time.Sleep(d)
	}
}

// For calls call until it returns nil, or limit has passed: then it answers call's last error.
func For(limit time.Duration, call func() error) error {
	var err error
	if Until(limit, func() bool { err = call(); return err == nil }) {
		return nil
	}
	return err
}

// Eventually fails t (at once) unless cond becomes true within limit; what says what was awaited.
func Eventually(t testing.TB, limit time.Duration, cond func() bool, what string, args ...any) {
	t.Helper()
	if !Until(limit, cond) {
		t.Fatalf("not within %s: %s", limit, fmt.Sprintf(what, args...))
	}
}

// Never fails t if cond becomes true within d; what says what must not happen.
func Never(t testing.TB, d time.Duration, cond func() bool, what string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(d)
	for p := poll; ; p = min(2*p, maxPoll) {
		if cond() {
			t.Fatalf("it happened: %s", fmt.Sprintf(what, args...))
			return
		}
		if time.Now().After(deadline) {
			return
		}
		time.Sleep(p)
	}
}
