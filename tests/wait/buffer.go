package wait

import (
	"strings"
	"sync"
	"testing"
	"time"
)

// Buffer collects what a program, a terminal or a logger writes while a test waits on it: writes
// and reads may come from different goroutines.
type Buffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String is everything written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// WaitFor fails t unless text is among what was written within limit.
func (s *Buffer) WaitFor(t testing.TB, limit time.Duration, text string) {
	t.Helper()
	Eventually(t, limit, func() bool { return strings.Contains(s.String(), text) }, "%q in the output:\n%q", text, s)
}
