package heartbeat_test

import (
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/heartbeat"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// Leases that run out at the same moment, five batches of them, are all warned by one sweep and all
// stopped by the first sweep after their warning window: no owner's sandbox overstays its lease by
// more than a sweep interval because many others expired with it. Before, one sweep warned at most
// one batch (200 by default), so the last of 1,000 were stopped four sweeps late. (Batches of 10
// here: the same code with 50 sandboxes instead of 1,000 to create.)
func TestMassExpiryTakesOneSweep(t *testing.T) {
	t.Parallel()
	const n, batch = 50, 10
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	sweeper := heartbeat.NewSweeper(heartbeat.Config{Store: b.Store, Sandboxes: b.Manager, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Now: clock.Now, Batch: batch})
	var wg sync.WaitGroup
	errs := make(chan error, n)
	names := make(chan string, n)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range names {
				if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: name, TTLSeconds: ttl(60)}); err != nil {
					errs <- err
				}
			}
		}()
	}
	for i := 0; i < n; i++ {
		names <- fmt.Sprintf("mass-%d", i)
	}
	close(names)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	clock.Advance(61 * time.Second) // every lease ran out a second ago, at the same moment
	r, err := sweeper.SweepOnce(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if r.Warned != n {
		t.Fatalf("the first sweep warned %d of %d expired sandboxes", r.Warned, n)
	}
	clock.Advance(31 * time.Second) // the warning window: half the 60 s lease
	r, err = sweeper.SweepOnce(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if r.Stopped != n {
		t.Fatalf("the first sweep after the warning window stopped %d of %d", r.Stopped, n)
	}
}
