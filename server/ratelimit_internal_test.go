package server

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

// A flood of failures from more addresses than the guard tracks keeps its memory bounded, and the
// failures past the bound are held back together instead of being forgotten, while a source that
// has not failed is never blocked by them (else the flood would lock every client out).
func TestAuthGuardIsBounded(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	g := &authGuard{max: 3, window: time.Minute, now: func() time.Time { return now }, m: map[string]*failures{}}
	for i := range 5 * maxSources {
		g.failed(fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255))
	}
	if n := g.size(); n > maxSources+1 {
		t.Fatalf("%d sources tracked, bound %d", n, maxSources)
	}
	if _, blocked := g.blocked("192.0.2.1"); blocked {
		t.Fatal("a source that never failed is blocked by the overflow of others' failures")
	}
	if _, over, _ := g.failed("192.0.2.1"); !over {
		t.Fatal("a failure of a new source while the table is full of live windows is counted with the overflow, which is over its limit")
	}
	// Once the windows end, their entries make room again.
	now = now.Add(time.Minute)
	if _, over, _ := g.failed("192.0.2.2"); over {
		t.Fatal("a first failure after the windows ended")
	}
	if n := g.size(); n > 2 {
		t.Fatalf("ended windows must be swept when the table is full: %d left", n)
	}
}

// Credential buckets stay bounded however many credentials come and go.
func TestCredBucketsAreBounded(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	cb := newCredBuckets(func() time.Time { return now })
	for i := range 3 * maxBuckets {
		cb.take(fmt.Sprint("key:", i), 10, 10)
		if i%1000 == 0 {
			now = now.Add(time.Second)
		}
	}
	if n := cb.size(); n > maxBuckets {
		t.Fatalf("%d buckets, bound %d", n, maxBuckets)
	}
}

// The source of a request is its peer address, never a header the client writes; IPv6 peers are
// grouped by /64.
func TestSourceOf(t *testing.T) {
	t.Parallel()
	for addr, want := range map[string]string{
		"192.0.2.7:5000":             "192.0.2.7",
		"[::ffff:192.0.2.7]:5000":    "192.0.2.7",
		"[2001:db8:1:2:3:4:5:6]:443": "2001:db8:1:2::/64",
	} {
		r := &http.Request{RemoteAddr: addr, Header: http.Header{"X-Forwarded-For": {"203.0.113.9"}}}
		if got := sourceOf(r); got != want {
			t.Errorf("sourceOf(%s) = %s, want %s", addr, got, want)
		}
	}
}

// BenchmarkCredBucketTake is the limiter's cost per request: one bucket, many goroutines.
func BenchmarkCredBucketTake(b *testing.B) {
	cb := newCredBuckets(time.Now)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			cb.take("key:bench", 1<<30, 1<<30)
		}
	})
}
