package store_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/sbxbroker/broker/store"
)

// testTransferUID: a pooled sandbox's uid moves to the claiming org and back without ever being
// free in between; a retried move answers the same uid; racing claims under two orgs move it once;
// a sandbox holding no uid is an error and changes nothing.
func testTransferUID(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	other := store.New(store.Raw(s))
	r := store.UIDRange{First: 400000, Last: 400001}
	uid, err := s.AllocateUID(ctx, r, store.PoolOrg, "sb_pooled")
	if err != nil {
		t.Fatal(err)
	}
	// While it moves, the range's other uid goes to someone else and this one never does.
	if _, err := s.AllocateUID(ctx, r, "o1", "sb_else"); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the second is a retry after a lost answer
		got, err := s.TransferUID(ctx, store.PoolOrg, "o1", "sb_pooled")
		if err != nil || got != uid {
			t.Fatalf("transfer to o1: %d, %v; want %d", got, err, uid)
		}
	}
	if owner, _ := s.UIDOwner(ctx, uid); owner != "o1/sb_pooled" {
		t.Fatalf("owner after the claim %q, want o1/sb_pooled", owner)
	}
	if _, err := s.AllocateUID(ctx, r, "o2", "sb_third"); err == nil {
		t.Fatal("a full range handed out a uid while one changed hands")
	}
	// Back to the pool (a claim that did not happen), then two orgs race for it: one wins.
	if got, err := s.TransferUID(ctx, "o1", store.PoolOrg, "sb_pooled"); err != nil || got != uid {
		t.Fatalf("transfer back: %d, %v", got, err)
	}
	var wg sync.WaitGroup
	wins := make(chan string, 2)
	for i, org := range []string{"o1", "o2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := []*store.Store{s, other}[i]
			if _, err := st.TransferUID(ctx, store.PoolOrg, org, "sb_pooled"); err == nil {
				wins <- org
			}
		}()
	}
	wg.Wait()
	close(wins)
	var won []string
	for o := range wins {
		won = append(won, o)
	}
	if len(won) != 1 {
		t.Fatalf("the pooled uid went to %v, want exactly one org", won)
	}
	if owner, _ := s.UIDOwner(ctx, uid); owner != fmt.Sprintf("%s/sb_pooled", won[0]) {
		t.Fatalf("owner %q after %s won", owner, won[0])
	}
	if _, err := s.TransferUID(ctx, store.PoolOrg, "o3", "sb_nothing"); err == nil {
		t.Fatal("moving the uid of a sandbox that holds none: no error")
	}
	for _, o := range []string{"o1", "o2"} {
		s.ReleaseUID(ctx, o, "sb_pooled")
	}
	s.ReleaseUID(ctx, "o1", "sb_else")
}
