package heartbeat

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/store"
)

// Lifecycle is what the sweeper does to sandboxes: the two lifecycle steps of sandbox.Manager it
// takes, each re-checked in one Lua step so that a heartbeat or a resume that lands first wins.
type Lifecycle interface {
	StopExpired(ctx context.Context, c sandbox.Caller, ref string, warning time.Duration) (store.Record, error)
	DeleteStopped(ctx context.Context, c sandbox.Caller, ref string, stoppedBy time.Time) (store.Record, error)
}

// Config wires a Sweeper.
type Config struct {
	Store     *store.Store
	Sandboxes Lifecycle
	// Events receives the sweeper's events (the broker's events.Writer.Emit); nil drops them.
	Events func(org string, e protocol.Event)
	Log    *slog.Logger
	// Now is the broker's clock, for event times only: every deadline decision is made on the
	// store's lease clock (Redis TIME), so that a broker with a wrong clock cannot stop anything early.
	Now func() time.Time
	// Interval between sweeps (default 2s).
	Interval time.Duration
	// Warning is how long before its deadline a sandbox gets an expiring event (default 1m; half the
	// lease when that is shorter). A stop always comes at least that long after the event.
	Warning time.Duration
	// Retention deletes sandboxes stopped longer than this; 0 keeps them forever.
	Retention time.Duration
	// Batch bounds the sandboxes one step takes from an index (default 200).
	Batch int
}

// Sweeper stops expired sandboxes. Several brokers may run one; a Redis lock lets one sweep at a
// time, and since every action is re-checked atomically in Redis, two sweeping at once (a lock lost
// to a pause) only duplicate work, never harm.
type Sweeper struct {
	cfg   Config
	token string
}

// NewSweeper builds a sweeper.
func NewSweeper(cfg Config) *Sweeper {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 2 * time.Second
	}
	if cfg.Warning <= 0 {
		cfg.Warning = time.Minute
	}
	if cfg.Batch <= 0 {
		cfg.Batch = 200
	}
	if cfg.Events == nil {
		cfg.Events = func(string, protocol.Event) {}
	}
	b := make([]byte, 12)
	rand.Read(b)
	return &Sweeper{cfg: cfg, token: hex.EncodeToString(b)}
}

// Report counts what one sweep did.
type Report struct {
	Warned, Stopped, Deleted int
}

// Run sweeps every Interval while this broker holds the lock, until ctx ends.
func (s *Sweeper) Run(ctx context.Context) {
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	defer s.release()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		held, err := s.lock(ctx)
		if err != nil {
			s.cfg.Log.Warn("sweeper: cannot reach the lock", "err", err)
			continue
		}
		if !held {
			continue
		}
		if r, err := s.SweepOnce(ctx); err != nil {
			s.cfg.Log.Error("sweep failed", "err", err)
		} else if r.Stopped+r.Deleted > 0 {
			s.cfg.Log.Info("sweep", "stopped", r.Stopped, "deleted", r.Deleted, "warned", r.Warned)
		}
	}
}

func (s *Sweeper) lock(ctx context.Context) (bool, error) {
	ttl := 3 * s.cfg.Interval
	return s.cfg.Store.HoldSweepLock(ctx, s.token, ttl)
}

func (s *Sweeper) release() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s.cfg.Store.ReleaseSweepLock(ctx, s.token)
}

// maxRounds bounds the batches one org gets per sweep, so one huge org cannot starve the others.
const maxRounds = 50

// stopConcurrency bounds the stops a sweep runs at once. A stop mostly waits (its record's
// transition in Redis, the sandbox's processes ending, its cgroups going): one after another, 200
// leases running out together were stopped up to 2.5 s after their deadlines, 1,000 would be 12 s.
const stopConcurrency = 16

// stopExpired stops the expired sandboxes ids, stopConcurrency at a time, and counts the stops.
func (s *Sweeper) stopExpired(ctx context.Context, caller sandbox.Caller, ids []string) int {
	var stopped atomic.Int64
	sem := make(chan struct{}, stopConcurrency)
	var wg sync.WaitGroup
	for _, id := range ids {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			// The stop re-checks the deadline and the warning atomically: a heartbeat that landed
			// since wins, and one whose warning is younger than its window waits.
			_, err := s.cfg.Sandboxes.StopExpired(ctx, caller, id, s.cfg.Warning)
			switch {
			case err == nil:
				stopped.Add(1)
			case isState(err):
			default:
				s.cfg.Log.Error("sweeper: stop failed", "org", caller.Org, "sandbox_id", id, "err", err)
			}
		}()
	}
	wg.Wait()
	return int(stopped.Load())
}

// SweepOnce does one sweep now, lock or not: expiry warnings, stops of expired sandboxes
// (reason ttl_expired), and retention deletes. After a Redis outage this broker saw, every lease
// first gets its grace (store.GrantGrace), so the outage stops nothing.
func (s *Sweeper) SweepOnce(ctx context.Context) (Report, error) {
	var r Report
	if err := s.cfg.Store.GrantGrace(ctx); err != nil {
		return r, err
	}
	orgs, err := s.cfg.Store.Orgs(ctx)
	if err != nil {
		return r, err
	}
	var errs []error
	for _, org := range orgs {
		if err := s.sweepOrg(ctx, org, &r); err != nil {
			errs = append(errs, err)
		}
	}
	return r, errors.Join(errs...)
}

func (s *Sweeper) sweepOrg(ctx context.Context, org string, r *Report) error {
	caller := sandbox.Caller{Org: org, Actor: "sweeper"}
	// The lease clock, read once: the candidates below are re-checked on it atomically.
	now, err := s.cfg.Store.Now(ctx)
	if err != nil {
		return err
	}
	// Warnings in batches, as many rounds as stops get: a mass expiry (1,000 leases running out at
	// once) is warned in one sweep, so its stops are not spread over later sweeps, one batch each.
	for round := 0; round < maxRounds; round++ {
		due, err := s.cfg.Store.WarnExpiring(ctx, org, s.cfg.Warning, s.cfg.Batch)
		if err != nil {
			return err
		}
		for _, w := range due {
			left := int64(w.StopAt.Sub(now).Round(time.Second) / time.Second)
			s.cfg.Events(org, protocol.Event{Type: protocol.EventExpiring, SandboxID: w.ID, Name: w.Name, Time: s.cfg.Now().UTC(),
				Actor: "sweeper", SecondsLeft: &left, Status: protocol.StatusRunning})
		}
		r.Warned += len(due)
		if len(due) < s.cfg.Batch {
			break
		}
	}
	for round := 0; round < maxRounds; round++ {
		ids, err := s.cfg.Store.Expired(ctx, org, now, s.cfg.Batch)
		if err != nil {
			return err
		}
		stopped := s.stopExpired(ctx, caller, ids)
		r.Stopped += stopped
		if len(ids) < s.cfg.Batch || stopped == 0 {
			break
		}
	}
	if s.cfg.Retention > 0 {
		cutoff := now.Add(-s.cfg.Retention)
		ids, err := s.cfg.Store.StoppedBefore(ctx, org, cutoff, s.cfg.Batch)
		if err != nil {
			return err
		}
		for _, id := range ids {
			// The delete re-checks atomically: a sandbox resumed since the read is kept.
			_, err := s.cfg.Sandboxes.DeleteStopped(ctx, caller, id, cutoff)
			switch {
			case err == nil:
				r.Deleted++
			case isState(err):
			default:
				s.cfg.Log.Error("sweeper: retention delete failed", "org", org, "sandbox_id", id, "err", err)
			}
		}
	}
	return nil
}

// isState reports errors that mean "someone else changed it first" (renewed, stopped, deleted).
func isState(err error) bool {
	var pe *protocol.Error
	return errors.As(err, &pe) && (pe.Code == protocol.CodeInvalidState || pe.Code == protocol.CodeNotFound || pe.Code == protocol.CodeNotRunning)
}
