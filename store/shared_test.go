package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

// Tests of what other packages keep in Redis through the store: delegation tokens' metadata, the
// deny-list and the revocation read, the sweep lock, pub/sub follows and the event stream. They run
// in TestStore's matrix (plain redis-server, Cluster, embedded).

func testTokens(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	rec, _, err := s.CreateOrReuse(ctx, newRecord("tok", "dev", nil), true)
	if err != nil {
		t.Fatal(err)
	}
	for i, jti := range []string{"j1", "j2", "j3"} {
		n, err := s.RecordToken(ctx, rec.Org, rec.ID, jti, []byte(`{"n":`+fmt.Sprint(i)+`}`), 0)
		if err != nil || n != int64(i+1) {
			t.Fatalf("record %s: size %d, %v; want %d", jti, n, err, i+1)
		}
	}
	if raw, err := s.Token(ctx, rec.Org, rec.ID, "j2"); err != nil || raw != `{"n":1}` {
		t.Fatalf("token j2: %q %v", raw, err)
	}
	if _, err := s.Token(ctx, rec.Org, rec.ID, "nope"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("unknown jti: %v, want ErrNotFound", err)
	}
	if _, err := s.Token(ctx, "other", rec.ID, "j1"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("a token read through another org: %v, want ErrNotFound", err)
	}
	if err := s.ForgetTokens(ctx, rec.Org, rec.ID, "j1", "j3"); err != nil {
		t.Fatal(err)
	}
	if err := s.ForgetTokens(ctx, rec.Org, rec.ID); err != nil {
		t.Fatalf("forgetting nothing: %v", err)
	}
	if all, err := s.Tokens(ctx, rec.Org, rec.ID); err != nil || len(all) != 1 || all["j2"] == "" {
		t.Fatalf("tokens after forgetting j1 and j3: %v %v", all, err)
	}

	// The deny-list entry lives as long as asked.
	if err := s.DenyToken(ctx, rec.Org, "j2", time.Minute); err != nil {
		t.Fatal(err)
	}
	if ttl := store.Raw(s).PTTL(ctx, store.RevokedKey(rec.Org, "j2")).Val(); ttl <= 50*time.Second || ttl > time.Minute {
		t.Fatalf("deny-list entry expires in %s, want about a minute", ttl)
	}

	// The listing read: denied jtis and live minting keys, in one call.
	_, live, err := s.CreateAPIKey(ctx, rec.Org, "live", t0)
	if err != nil {
		t.Fatal(err)
	}
	_, gone, err := s.CreateAPIKey(ctx, rec.Org, "gone", t0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.RevokeAPIKey(ctx, gone.ID, t0); err != nil {
		t.Fatal(err)
	}
	_, foreign, err := s.CreateAPIKey(ctx, "tok-other", "foreign", t0)
	if err != nil {
		t.Fatal(err)
	}
	denied, keys, err := s.TokensRevoked(ctx, rec.Org, []string{"j2", "j9"}, []string{live.ID, gone.ID, foreign.ID, "unknown"})
	if err != nil {
		t.Fatal(err)
	}
	if !denied["j2"] || denied["j9"] {
		t.Fatalf("denied: %v, want j2 only", denied)
	}
	if !keys[live.ID] || keys[gone.ID] || keys[foreign.ID] || keys["unknown"] {
		t.Fatalf("live keys: %v, want only %s (a revoked key, another org's and an unknown one are not)", keys, live.ID)
	}
	if d, k, err := s.TokensRevoked(ctx, rec.Org, nil, nil); err != nil || len(d)+len(k) != 0 {
		t.Fatalf("nothing asked: %v %v %v", d, k, err)
	}

	// The verification read.
	st, err := s.TokenState(ctx, rec.Org, rec.ID, "j1", live.ID)
	if err != nil {
		t.Fatal(err)
	}
	if want := (store.TokenState{Gen: rec.Gen, Status: protocol.StatusProvisioning, KeyLive: true}); st != want {
		t.Fatalf("state of a good token: %+v, want %+v", st, want)
	}
	gen, err := s.BumpGen(ctx, rec.Org, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	st, err = s.TokenState(ctx, rec.Org, rec.ID, "j2", gone.ID)
	if err != nil {
		t.Fatal(err)
	}
	if want := (store.TokenState{Denied: true, Gen: gen, Status: protocol.StatusProvisioning}); st != want || gen <= rec.Gen {
		t.Fatalf("state of a denied token of a revoked key after a generation bump: %+v, want %+v", st, want)
	}
	st, err = s.TokenState(ctx, rec.Org, "sb_gone", "j1", foreign.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !st.SandboxGone || st.KeyLive {
		t.Fatalf("state of a token of no sandbox, minted by another org's key: %+v", st)
	}
	if st, err := s.TokenState(ctx, rec.Org, rec.ID, "j1", ""); err != nil || st.KeyLive {
		t.Fatalf("a token naming no key: %+v %v", st, err)
	}
}

func testSweepLock(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	held, err := s.HoldSweepLock(ctx, "a", time.Minute)
	if err != nil || !held {
		t.Fatalf("a free lock: %v %v", held, err)
	}
	if held, err := s.HoldSweepLock(ctx, "b", time.Minute); err != nil || held {
		t.Fatalf("b took a's lock: %v %v", held, err)
	}
	store.Raw(s).PExpire(ctx, store.SweepLockKey, time.Second)
	if held, err := s.HoldSweepLock(ctx, "a", time.Minute); err != nil || !held {
		t.Fatalf("a renewing: %v %v", held, err)
	}
	if ttl := store.Raw(s).PTTL(ctx, store.SweepLockKey).Val(); ttl <= 50*time.Second {
		t.Fatalf("a renewal left the lock %s to live, want about a minute", ttl)
	}
	if err := s.ReleaseSweepLock(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if held, _ := s.HoldSweepLock(ctx, "b", time.Minute); held {
		t.Fatal("b released a's lock")
	}
	if err := s.ReleaseSweepLock(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if held, err := s.HoldSweepLock(ctx, "b", time.Minute); err != nil || !held {
		t.Fatalf("b after a released: %v %v", held, err)
	}
	s.ReleaseSweepLock(ctx, "b")
}

func testFollow(t *testing.T, s *store.Store, clk *clock) {
	// Confirmed: what is published once Follow returns arrives, every time. One Redis keeps the
	// order of separate publishes; a Cluster does not (each PUBLISH may enter at another node and
	// travel the cluster bus from there), so there only arrival is checked.
	_, single := store.Raw(s).(*redis.Client)
	for i := range 20 {
		ctx, cancel := context.WithCancel(t.Context())
		channel := fmt.Sprintf("sbx:test:follow:%d", i)
		got := make(chan string, 4)
		if err := s.Follow(ctx, channel, func(p string) { got <- p }); err != nil {
			t.Fatal(err)
		}
		for _, m := range []string{"one", "two"} {
			if err := s.Publish(ctx, channel, m); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Publish(ctx, channel, "x", "y"); err != nil {
			t.Fatal(err)
		}
		var all []string
		for range 4 {
			select {
			case p := <-got:
				all = append(all, p)
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d: messages published after Follow returned never arrived (got %q)", i, all)
			}
		}
		for _, want := range []string{"one", "two", "x", "y"} {
			if !slices.Contains(all, want) {
				t.Fatalf("round %d: got %q, want %q too", i, all, want)
			}
		}
		if single && (all[0] != "one" || all[1] != "two") {
			t.Fatalf("round %d: got %q, want one, two in order first", i, all)
		}
		cancel()
	}
	// The end of ctx closes the subscription (seen from Redis, where there is one server to ask).
	if c, ok := store.Raw(s).(*redis.Client); ok {
		ctx, cancel := context.WithCancel(t.Context())
		if err := s.Follow(ctx, "sbx:test:follow:end", func(string) {}); err != nil {
			t.Fatal(err)
		}
		if n := c.PubSubNumSub(t.Context(), "sbx:test:follow:end").Val()["sbx:test:follow:end"]; n != 1 {
			t.Fatalf("%d subscribers while following, want 1", n)
		}
		cancel()
		wait.Eventually(t, 10*time.Second, func() bool {
			return c.PubSubNumSub(t.Context(), "sbx:test:follow:end").Val()["sbx:test:follow:end"] == 0
		}, "the subscription ends with its context")
	}
	// A subscription cut and made again calls gap, in order with the messages: one published after
	// gap arrives (one Redis to cut its subscribers on).
	if c, ok := store.Raw(s).(*redis.Client); ok {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		got, gaps := make(chan string, 4), make(chan struct{}, 4)
		channel := "sbx:test:follow:gap"
		if err := s.FollowWithGaps(ctx, channel, func(p string) { got <- p }, func() { gaps <- struct{}{} }); err != nil {
			t.Fatal(err)
		}
		if err := c.Do(ctx, "CLIENT", "KILL", "TYPE", "pubsub").Err(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-gaps:
		case <-time.After(10 * time.Second):
			t.Fatal("no gap within 10 s of the subscription's cut")
		}
		if err := s.Publish(ctx, channel, "after"); err != nil {
			t.Fatal(err)
		}
		select {
		case p := <-got:
			if p != "after" {
				t.Fatalf("got %q after the gap, want after", p)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a message published after the gap did not arrive")
		}
	}
	// A Follow that cannot subscribe says so.
	dead, cancel := context.WithCancel(t.Context())
	cancel()
	if err := s.Follow(dead, "sbx:test:follow:dead", func(string) {}); err == nil {
		t.Fatal("Follow with an ended context succeeded")
	}
}

func testEventStream(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	if _, err := s.EventsInfo(ctx, "ev-none"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("info of no stream: %v, want ErrNotFound", err)
	}
	if got, err := s.LatestEvents(ctx, "ev-none", 5); err != nil || len(got) != 0 {
		t.Fatalf("latest of no stream: %v %v", got, err)
	}
	var batch []store.StreamAppend
	for i := range 6 {
		batch = append(batch, store.StreamAppend{Org: []string{"ev-a", "ev-b"}[i%2], Data: []byte(fmt.Sprint(i))})
	}
	ok, err := s.AppendEvents(ctx, batch, 1000)
	if err != nil || len(ok) != 6 {
		t.Fatal(ok, err)
	}
	for i, b := range ok {
		if !b {
			t.Fatalf("entry %d not appended", i)
		}
	}
	all, err := s.EventsAfter(ctx, "ev-a", "0-0", 0)
	if err != nil || len(all) != 3 || all[0].Data != "0" || all[1].Data != "2" || all[2].Data != "4" {
		t.Fatalf("org a's stream: %+v %v", all, err)
	}
	if page, err := s.EventsAfter(ctx, "ev-a", all[0].ID, 1); err != nil || len(page) != 1 || page[0] != all[1] {
		t.Fatalf("one entry after the first: %+v %v, want %+v", page, err, all[1])
	}
	if rest, err := s.EventsAfter(ctx, "ev-a", all[2].ID, 0); err != nil || len(rest) != 0 {
		t.Fatalf("after the last: %+v %v", rest, err)
	}
	if last, err := s.LatestEvents(ctx, "ev-b", 2); err != nil || len(last) != 2 || last[0].Data != "5" || last[1].Data != "3" {
		t.Fatalf("org b's latest two: %+v %v", last, err)
	}
	info, err := s.EventsInfo(ctx, "ev-a")
	if err != nil || info.FirstID != all[0].ID || info.LastGeneratedID != all[2].ID || info.Length != 3 || info.EntriesAdded != 3 {
		t.Fatalf("info of org a: %+v %v", info, err)
	}
	// AppendEventsAndWake wakes the followers of a channel with each org appended to, once per
	// org, never before its append: a follower that reads the stream on its wake-up finds the event.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	woken := make(chan string, 8)
	channel := "sbx:test:events:wake"
	if err := s.Follow(wctx, channel, func(org string) {
		got, err := s.EventsAfter(wctx, org, "0-0", 0)
		woken <- fmt.Sprint(org, " ", len(got), " ", err)
	}); err != nil {
		t.Fatal(err)
	}
	batch = []store.StreamAppend{{Org: "ev-w1", Data: []byte("a")}, {Org: "ev-w2", Data: []byte("b")}, {Org: "ev-w1", Data: []byte("c")}}
	if ok, err := s.AppendEventsAndWake(ctx, batch, 1000, channel); err != nil || !ok[0] || !ok[1] || !ok[2] {
		t.Fatal(ok, err)
	}
	var wakes []string
	for range 2 {
		select {
		case w := <-woken:
			wakes = append(wakes, w)
		case <-time.After(10 * time.Second):
			t.Fatalf("wake-ups after the append: %q, want one per org", wakes)
		}
	}
	slices.Sort(wakes)
	if want := []string{"ev-w1 2 <nil>", "ev-w2 1 <nil>"}; !slices.Equal(wakes, want) {
		t.Fatalf("wake-ups (org, entries found then): %q, want %q", wakes, want)
	}

	// Trimmed to about maxLen: fewer held than added, the oldest gone.
	batch = batch[:0]
	for i := range 500 {
		batch = append(batch, store.StreamAppend{Org: "ev-trim", Data: []byte(fmt.Sprint(i))})
	}
	if _, err := s.AppendEvents(ctx, batch, 10); err != nil {
		t.Fatal(err)
	}
	info, err = s.EventsInfo(ctx, "ev-trim")
	if err != nil || info.EntriesAdded != 500 || info.Length >= 500 {
		t.Fatalf("info of a trimmed stream: %+v %v", info, err)
	}
	if first, err := s.EventsAfter(ctx, "ev-trim", "0-0", 1); err != nil || len(first) != 1 || first[0].Data == "0" || first[0].ID != info.FirstID {
		t.Fatalf("oldest entry of a trimmed stream: %+v %v", first, err)
	}
}

func testPingAndOrgs(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.CreateAPIKey(ctx, "known", "k", t0); err != nil {
		t.Fatal(err)
	}
	for org, want := range map[string]bool{"known": true, "unknown": false} {
		if got, err := s.OrgExists(ctx, org); err != nil || got != want {
			t.Fatalf("org %s exists: %v %v, want %v", org, got, err, want)
		}
	}
}
