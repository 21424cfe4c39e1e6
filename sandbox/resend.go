package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/sbxbroker/broker/store"
)

// When Redis runs a create or a resume and its answer is lost (a network blip, a failover between
// the write and the reply), nobody knows whether it happened. Guessing is wrong both ways: taken as
// a refusal, the broker frees the name and uid of a record that exists (left provisioning with
// nobody to start it, its uid handed to the next sandbox); taken as done, it keeps those of one that
// does not. So the call is sent again until an answer arrives: the store recognises its own create
// (by the new sandbox's id) and its own resume (by the claim it writes), and a resent call answers
// as the first would have.

// errUnknownOutcome marks a create or resume whose every answer Redis lost: it may or may not have
// happened.
var errUnknownOutcome = errors.New("the outcome is unknown")

// resend runs call, and again for about 3 s while its answer may have been lost: Redis away, or the
// caller's hang-up cutting the Redis client's own resend. It goes on without the caller, as a start
// that reached the store does (provision). An answer still missing is errUnknownOutcome.
func resend[T any](ctx context.Context, log *slog.Logger, what string, call func(context.Context) (T, error)) (T, error) {
	lost := func(err error) bool { return store.Unavailable(err) || errors.Is(err, context.Canceled) }
	v, err := call(ctx)
	ctx = context.WithoutCancel(ctx)
	for wait := 100 * time.Millisecond; err != nil && lost(err) && wait <= 1600*time.Millisecond; wait *= 4 {
		if !errors.Is(err, context.Canceled) {
			time.Sleep(wait)
		}
		log.Warn("Redis' answer to a "+what+" was lost; asking again", "err", err)
		v, err = call(ctx)
	}
	if err != nil && lost(err) {
		return v, fmt.Errorf("%w: %w", errUnknownOutcome, err)
	}
	return v, err
}

// createOrReuse is Store.CreateOrReuse, resent while its answer may have been lost.
func (m *Manager) createOrReuse(ctx context.Context, rec store.Record, reuse bool) (store.Record, store.Outcome, error) {
	type answer struct {
		rec     store.Record
		outcome store.Outcome
	}
	a, err := resend(ctx, m.cfg.Log.With("sandbox_id", rec.ID, "org", rec.Org), "create", func(ctx context.Context) (answer, error) {
		got, outcome, err := m.cfg.Store.CreateOrReuse(ctx, rec, reuse)
		return answer{got, outcome}, err
	})
	return a.rec, a.outcome, err
}
