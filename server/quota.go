package server

import (
	"context"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// quota is an amount shared by many holders (slots, bytes): at most max is in use, and at most share
// by any one key (an org), so that one org whose clients never read cannot hold all of it. Every
// amount taken is given back with release, by the one that took it.
type quota struct {
	max, share int64

	mu    sync.Mutex
	used  int64
	byKey map[string]int64
	// wake is closed (and replaced) whenever an amount is given back, so that waiters look again.
	wake chan struct{}
}

// newQuota makes a quota of max with at most share for one key (share <= 0 or > max: max).
func newQuota(max, share int64) *quota {
	if share <= 0 || share > max {
		share = max
	}
	return &quota{max: max, share: share, byKey: map[string]int64{}, wake: make(chan struct{})}
}

// fits says whether key may take n more. A key holding nothing may take an amount larger than its
// share or the whole (one answer bigger than a queue), as long as nothing else is held: a bound must
// not turn into a request that can never be served.
func (q *quota) fits(key string, n int64) bool {
	held := q.byKey[key]
	if held == 0 && q.used == 0 {
		return true
	}
	return q.used+n <= q.max && held+n <= q.share
}

func (q *quota) take(key string, n int64) {
	q.used += n
	q.byKey[key] += n
}

// tryAcquire takes n for key if it fits now.
func (q *quota) tryAcquire(key string, n int64) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.fits(key, n) {
		return false
	}
	q.take(key, n)
	return true
}

// acquire takes n for key, waiting until it fits or ctx ends.
func (q *quota) acquire(ctx context.Context, key string, n int64) error {
	for {
		q.mu.Lock()
		if q.fits(key, n) {
			q.take(key, n)
			q.mu.Unlock()
			return nil
		}
		wake := q.wake
		q.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// force takes n for key whether it fits or not: for bytes that exist already (an answer encoded
// from output that was within the quota), which must be counted to be true.
func (q *quota) force(key string, n int64) {
	q.mu.Lock()
	q.take(key, n)
	q.mu.Unlock()
}

// release gives back n that key took.
func (q *quota) release(key string, n int64) {
	if n == 0 {
		return
	}
	q.mu.Lock()
	q.used -= n
	if q.byKey[key] -= n; q.byKey[key] <= 0 {
		delete(q.byKey, key)
	}
	close(q.wake)
	q.wake = make(chan struct{})
	q.mu.Unlock()
}

// inUse is the amount taken, and by key.
func (q *quota) inUse(key string) (all, byKey int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.used, q.byKey[key]
}

// dataplaneGauges export the dataplane's accounting: what clients hold of the shared slots, the
// exec output budget, the queues and the op memory budget.
func (s *Server) dataplaneGauges() []prometheus.Collector {
	gauge := func(name, help string, q *quota) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 {
			all, _ := q.inUse("")
			return float64(all)
		})
	}
	return []prometheus.Collector{
		gauge("sbx_dataplane_heavy_slots", "Broker-wide read/ls/glob/grep slots held, until their answers are written.", s.dpHeavy),
		gauge("sbx_dataplane_exec_output_bytes", "Non-streamed exec output held against the broker-wide budget, until written.", s.dpExecOutput),
		gauge("sbx_dataplane_queued_bytes", "Bytes waiting to be written to dataplane clients.", s.dpQueued),
		gauge("sbx_dataplane_op_memory_bytes", "What dataplane operations build in memory (names, answers) against the broker-wide budget.", s.dpOpMemory),
	}
}
