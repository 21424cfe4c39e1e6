package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
)

// REST answers and dataplane answers map errors through one table: the same cause gets the same code
// on both. (A provider's errors reach the server already translated: sandbox's TestExecErrors.)
func TestErrorMappingIsShared(t *testing.T) {
	t.Parallel()
	c := &dpConn{s: &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	cases := []struct {
		name    string
		err     error
		code    string
		message string // "" = not checked
	}{
		{"deadline", fmt.Errorf("store: get: %w", context.DeadlineExceeded), protocol.CodeUnavailable, ""},
		{"redis closed", fmt.Errorf("store: get: %w", redis.ErrClosed), protocol.CodeUnavailable, ""},
		{"protocol error", protocol.Errorf(protocol.CodeNotFound, "no such file"), protocol.CodeNotFound, "no such file"},
		{"anything else", fmt.Errorf("disk on fire"), protocol.CodeInternal, ""},
	}
	for _, tc := range cases {
		_, rest := apiError(tc.err)
		dp := c.errorResponse(7, tc.err).Error
		if rest.Code != tc.code || dp.Code != tc.code {
			t.Errorf("%s: REST %s, dataplane %s, want %s", tc.name, rest.Code, dp.Code, tc.code)
		}
		if tc.message != "" && (rest.Message != tc.message || dp.Message != tc.message) {
			t.Errorf("%s: REST %q, dataplane %q, want %q", tc.name, rest.Message, dp.Message, tc.message)
		}
		if tc.code == protocol.CodeInternal && (dp.Message == "" || dp.Message == rest.Message || dp.RequestID != "") {
			t.Errorf("%s: dataplane message %+v should name request 7 and nothing internal", tc.name, dp)
		}
	}
	if got := c.errorResponse(7, fmt.Errorf("read: %w", context.Canceled)).Error; got.Code != protocol.CodeCancelled {
		t.Errorf("cancelled request: %+v", got)
	}
}

// Concurrent upgrades cannot overshoot the connection bound: the count is taken before any check.
func TestHubReserveBound(t *testing.T) {
	t.Parallel()
	h := newHub()
	const max, tries = 10, 200
	var (
		mu       sync.Mutex
		releases []func()
		wg       sync.WaitGroup
		start    = make(chan struct{})
	)
	for range tries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if release, ok := h.reserve(max); ok {
				mu.Lock()
				releases = append(releases, release)
				mu.Unlock()
			}
		}()
	}
	close(start)
	wg.Wait()
	if len(releases) != max || h.count() != max {
		t.Fatalf("%d reservations granted, count %d; want %d", len(releases), h.count(), max)
	}
	if _, ok := h.reserve(max); ok {
		t.Fatal("a reservation past the bound was granted")
	}
	releases[0]()
	releases[0]() // once only
	if h.count() != max-1 {
		t.Fatalf("count %d after one release (twice), want %d", h.count(), max-1)
	}
	for _, r := range releases[1:] {
		r()
	}
	if h.count() != 0 {
		t.Fatalf("count %d after every release", h.count())
	}
}

// The provider keeps its own exec timeouts (sbx-init links it, and must not pay for package
// protocol's initializers); they must stay those that protocol documents and Local applies.
func TestExecLimitsAgree(t *testing.T) {
	if provider.DefaultExecTimeout != protocol.ExecDefaultTimeout || provider.DefaultExecTimeoutMax != protocol.ExecMaxTimeout {
		t.Fatalf("provider exec timeouts %s/%s, protocol %s/%s", provider.DefaultExecTimeout, provider.DefaultExecTimeoutMax,
			protocol.ExecDefaultTimeout, protocol.ExecMaxTimeout)
	}
}
