package store_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// max_running holds in the scripts on every backend (Cluster included: the active set and the
// limits hash carry the org's hash tag), under racing creates; org limits are validated.
func TestOrgLimits(t *testing.T) {
	for name, connect := range backends(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := store.New(connect(t))
			s.SetDefaultLimits(store.Limits{MaxRunning: 3})
			ctx := t.Context()
			if _, _, err := s.CreateAPIKey(ctx, "acme", "k", t0); err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			errs := make(chan error, 10)
			for i := range 10 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, _, err := s.CreateOrReuse(ctx, newRecord("acme", "n"+string(rune('a'+i)), map[string]string{"t": "x"}), true)
					errs <- err
				}()
			}
			wg.Wait()
			close(errs)
			ok, quota := 0, 0
			for err := range errs {
				var qe *store.QuotaError
				switch {
				case err == nil:
					ok++
				case errors.As(err, &qe) && qe.Limit == 3 && qe.Org == "acme" && errors.Is(err, store.ErrQuota):
					quota++
				default:
					t.Fatalf("create: %v", err)
				}
			}
			if ok != 3 || quota != 7 {
				t.Fatalf("10 racing creates under max_running 3: %d created, %d refused", ok, quota)
			}
			if n, err := s.Running(ctx, "acme"); err != nil || n != 3 {
				t.Fatalf("running: %d %v", n, err)
			}
			// The org's own limit wins over the default; 0 is no limit.
			if err := s.SetOrgLimits(ctx, "acme", map[string]int{store.LimitMaxRunning: 0}, nil); err != nil {
				t.Fatal(err)
			}
			if _, _, err := s.CreateOrReuse(ctx, newRecord("acme", "more", nil), true); err != nil {
				t.Fatalf("no limit: %v", err)
			}
			// Moving out of provisioning/running frees the place; the recount agrees with the records.
			rec, err := s.Get(ctx, "acme", "more")
			if err != nil {
				t.Fatal(err)
			}
			// A status change into running counts the sandbox even if the count lost it (a record an
			// older broker moved).
			store.Raw(s).Del(ctx, store.ActiveKey("acme"))
			if _, err := s.Transition(ctx, "acme", rec.ID, store.Transition{From: []string{protocol.StatusProvisioning}, To: protocol.StatusRunning}); err != nil {
				t.Fatal(err)
			}
			if n, _ := s.Running(ctx, "acme"); n != 1 {
				t.Fatalf("a move to running must count the sandbox: %d", n)
			}
			if _, err := s.Transition(ctx, "acme", rec.ID, store.Transition{From: []string{protocol.StatusRunning}, To: protocol.StatusFailed}); err != nil {
				t.Fatal(err)
			}
			if err := s.RecountRunning(ctx); err != nil {
				t.Fatal(err)
			}
			if n, _ := s.Running(ctx, "acme"); n != 3 {
				t.Fatalf("after a failure and a recount: %d running, want 3", n)
			}
			counts, err := s.RunningByOrg(ctx, 100)
			if err != nil || counts["acme"] != 3 {
				t.Fatalf("running by org: %v %v", counts, err)
			}
			// Bad input changes nothing.
			for _, tc := range []struct {
				org string
				set map[string]int
			}{
				{"acme", map[string]int{"max_widgets": 1}},
				{"acme", map[string]int{store.LimitRPS: -1}},
				{"acme", map[string]int{store.LimitRPS: store.MaxLimit + 1}},
				{"nosuch", map[string]int{store.LimitRPS: 5}},
			} {
				if err := s.SetOrgLimits(ctx, tc.org, tc.set, nil); err == nil {
					t.Errorf("SetOrgLimits(%s, %v) accepted", tc.org, tc.set)
				}
			}
			own, err := s.OrgLimits(ctx, "acme")
			if err != nil || len(own) != 1 || own[store.LimitMaxRunning] != 0 {
				t.Fatalf("own limits after refused changes: %v %v", own, err)
			}
			if err := s.SetOrgLimits(ctx, "acme", nil, []string{store.LimitMaxRunning}); err != nil {
				t.Fatal(err)
			}
			if l, err := s.EffectiveLimits(ctx, "acme"); err != nil || l.MaxRunning != 3 {
				t.Fatalf("back to the default: %+v %v", l, err)
			}
		})
	}
}
