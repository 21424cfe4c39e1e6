package gitsync

import (
	"fmt"
	"os"
	"time"
)

// tracer prints how long each phase took to stderr when SBCTL_TRACE is set.
type tracer struct {
	on   bool
	last time.Time
}

func newTracer() *tracer { return &tracer{on: os.Getenv("SBCTL_TRACE") != "", last: time.Now()} }

func (t *tracer) mark(what string) {
	if !t.on {
		return
	}
	now := time.Now()
	fmt.Fprintf(os.Stderr, "sbctl: trace: %-22s %6.1f ms\n", what, float64(now.Sub(t.last).Microseconds())/1000)
	t.last = now
}
