package store_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
)

// backends runs each store test against a plain redis-server, a three-node Cluster and the embedded
// default.
func backends(t *testing.T) map[string]func(t *testing.T) redis.UniversalClient {
	return map[string]func(t *testing.T) redis.UniversalClient{
		"redis-server": func(t *testing.T) redis.UniversalClient { return redistest.Start(t).Client(t) },
		"cluster":      func(t *testing.T) redis.UniversalClient { return redistest.StartCluster(t) },
		"embedded": func(t *testing.T) redis.UniversalClient {
			e, err := store.StartEmbedded(t.Context(), t.TempDir(), slog.New(slog.NewTextHandler(io.Discard, nil)))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(e.Stop)
			c := redis.NewUniversalClient(e.Options())
			t.Cleanup(func() { c.Close() })
			return c
		},
	}
}

var t0 = time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)

// clock is the lease clock the tests move by hand (store.Options.Clock), in place of Redis TIME.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *clock) Set(t time.Time) { c.mu.Lock(); c.t = t; c.mu.Unlock() }

func newRecord(org, name string, tags map[string]string) store.Record {
	return store.Record{
		ID: "sb_" + uuid.NewString(), Org: org, Name: name, Template: "default", Provider: "dir",
		Node: "n1", Status: protocol.StatusProvisioning, Tags: tags, TTL: 30 * time.Second,
		CreatedAt: t0, CreatedBy: "key:test", Heartbeat: t0,
	}
}

func TestStore(t *testing.T) {
	for name, connect := range backends(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			clk := &clock{t: t0}
			s := store.NewWithOptions(connect(t), store.Options{Clock: clk.Now})
			for _, tc := range []struct {
				name string
				fn   func(t *testing.T, s *store.Store, clk *clock)
			}{
				{"CreateReuseResume", testCreateReuseResume},
				{"ConcurrentCreateOneName", testConcurrentCreate},
				{"OrgIsolation", testOrgIsolation},
				{"LeaseAndSweepRecheck", testLease},
				{"ListFiltersAndPages", testList},
				{"DeleteFreesNameAndBumpsGen", testDelete},
				{"APIKeys", testAPIKeys},
				{"ExpiryWarnings", testExpiryWarnings},
				{"UIDs", testUIDs},
				{"TransferUID", testTransferUID},
				{"Tokens", testTokens},
				{"SweepLock", testSweepLock},
				{"Follow", testFollow},
				{"EventStream", testEventStream},
				{"PingAndOrgs", testPingAndOrgs},
			} {
				t.Run(tc.name, func(t *testing.T) { clk.Set(t0); tc.fn(t, s, clk) })
			}
		})
	}
}

func testCreateReuseResume(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	rec := newRecord("acme", "dev", map[string]string{"thread_id": "t1"})
	got, out, err := s.CreateOrReuse(ctx, rec, true)
	if err != nil || out != protocol.OutcomeCreated || got.ID != rec.ID || got.Tags["thread_id"] != "t1" {
		t.Fatalf("create: %v %v %+v", out, err, got)
	}
	again := newRecord("acme", "dev", nil)
	got, out, err = s.CreateOrReuse(ctx, again, true)
	if err != nil || out != protocol.OutcomeReused || got.ID != rec.ID {
		t.Fatalf("reuse: %v %v %+v", out, err, got)
	}
	if _, _, err := s.CreateOrReuse(ctx, again, false); !errors.Is(err, store.ErrNameConflict) {
		t.Fatalf("no-reuse: want ErrNameConflict, got %v", err)
	}
	other := newRecord("acme", "dev", nil)
	other.Template = "python"
	if _, _, err := s.CreateOrReuse(ctx, other, true); !errors.Is(err, store.ErrTemplateMismatch) {
		t.Fatalf("other template: want ErrTemplateMismatch, got %v", err)
	}
	// provisioning -> running starts a lease; running -> stopped ends it; reuse resumes.
	r, err := s.Transition(ctx, "acme", "dev", store.Transition{From: []string{"provisioning"}, To: "running"})
	if err != nil || r.Status != "running" || !r.ExpiresAt.Equal(t0.Add(30*time.Second)) {
		t.Fatalf("to running: %v %+v", err, r)
	}
	clk.Set(t0.Add(time.Second))
	r, err = s.Transition(ctx, "acme", rec.ID, store.Transition{
		From: []string{"running"}, To: "stopped", Fields: map[string]string{store.FieldStopReason: "requested"}})
	if err != nil || r.Status != "stopped" || r.StopReason != "requested" || !r.ExpiresAt.IsZero() || r.StoppedAt.IsZero() {
		t.Fatalf("to stopped: %v %+v", err, r)
	}
	got, out, err = s.CreateOrReuse(ctx, newRecord("acme", "dev", nil), true)
	if err != nil || out != protocol.OutcomeResumed || got.Status != "provisioning" || got.StopReason != "" {
		t.Fatalf("resume through create: %v %v %+v", out, err, got)
	}
	// A second racer sees it provisioning and merely reuses it.
	if _, out, _ := s.CreateOrReuse(ctx, newRecord("acme", "dev", nil), true); out != protocol.OutcomeReused {
		t.Fatalf("second resumer: %v", out)
	}
	if _, err := s.Transition(ctx, "acme", "dev", store.Transition{From: []string{"stopped"}, To: "running"}); !errors.Is(err, store.ErrWrongState) {
		t.Fatalf("wrong from-state: %v", err)
	}
}

func testConcurrentCreate(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	var wg sync.WaitGroup
	outcomes := make(chan store.Outcome, 50)
	ids := make(chan string, 50)
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, out, err := s.CreateOrReuse(ctx, newRecord("race", "one", nil), true)
			if err != nil {
				t.Error(err)
				return
			}
			outcomes <- out
			ids <- r.ID
		}()
	}
	wg.Wait()
	close(outcomes)
	close(ids)
	count := map[store.Outcome]int{}
	for o := range outcomes {
		count[o]++
	}
	seen := map[string]bool{}
	for id := range ids {
		seen[id] = true
	}
	if count[protocol.OutcomeCreated] != 1 || count[protocol.OutcomeReused] != 49 || len(seen) != 1 {
		t.Fatalf("want 1 created + 49 reused of one id, got %v over %d ids", count, len(seen))
	}
	all, err := s.ListAll(ctx, "race", store.Filter{})
	if err != nil || len(all) != 1 {
		t.Fatalf("want one record, got %d (%v)", len(all), err)
	}
}

func testOrgIsolation(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	rec := newRecord("org-a", "secret", nil)
	if _, _, err := s.CreateOrReuse(ctx, rec, true); err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{rec.ID, "secret"} {
		if _, err := s.Get(ctx, "org-b", ref); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("org-b get %s: want not found, got %v", ref, err)
		}
		if _, err := s.Transition(ctx, "org-b", ref, store.Transition{From: []string{"provisioning"}, To: "deleting"}); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("org-b delete %s: want not found, got %v", ref, err)
		}
		if _, err := s.Heartbeat(ctx, "org-b", ref); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("org-b heartbeat %s: want not found, got %v", ref, err)
		}
	}
	if r, err := s.Get(ctx, "org-a", "secret"); err != nil || r.Status != "provisioning" {
		t.Fatalf("org-a's sandbox changed: %v %+v", err, r)
	}
}

func testLease(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	rec := newRecord("lease", "hb", nil)
	s.CreateOrReuse(ctx, rec, true)
	if _, err := s.Heartbeat(ctx, "lease", "hb"); !errors.Is(err, store.ErrWrongState) {
		t.Fatalf("heartbeat of a provisioning sandbox: want wrong state, got %v", err)
	}
	s.Transition(ctx, "lease", "hb", store.Transition{From: []string{"provisioning"}, To: "running"})
	clk.Set(t0.Add(10 * time.Second))
	l, err := s.Heartbeat(ctx, "lease", "hb")
	if err != nil || !l.ExpiresAt.Equal(t0.Add(40*time.Second)) {
		t.Fatalf("heartbeat: %v %+v", err, l)
	}
	if ids, _ := s.Expired(ctx, "lease", t0.Add(39*time.Second), 10); len(ids) != 0 {
		t.Fatalf("expired too early: %v", ids)
	}
	if ids, _ := s.Expired(ctx, "lease", t0.Add(40*time.Second), 10); len(ids) != 1 || ids[0] != rec.ID {
		t.Fatalf("expired: %v", ids)
	}
	// The sweeper saw the old deadline; a heartbeat landed before its stop: the heartbeat wins.
	sweptAt := t0.Add(40 * time.Second)
	clk.Set(sweptAt)
	s.Heartbeat(ctx, "lease", "hb")
	_, err = s.Transition(ctx, "lease", rec.ID, store.Transition{
		From: []string{"running"}, To: "stopped", IfExpired: true})
	if !errors.Is(err, store.ErrWrongState) {
		t.Fatalf("sweep after heartbeat: want refused, got %v", err)
	}
	later := sweptAt.Add(31 * time.Second)
	clk.Set(later)
	r, err := s.Transition(ctx, "lease", rec.ID, store.Transition{
		From: []string{"running"}, To: "stopped", IfExpired: true, Fields: map[string]string{store.FieldStopReason: "ttl_expired"}})
	if err != nil || r.StopReason != "ttl_expired" {
		t.Fatalf("sweep after expiry: %v %+v", err, r)
	}
	if ids, _ := s.Expired(ctx, "lease", later, 10); len(ids) != 0 {
		t.Fatalf("stopped sandbox still has a deadline: %v", ids)
	}
	if ids, _ := s.StoppedBefore(ctx, "lease", later, 10); len(ids) != 1 {
		t.Fatalf("stopped index: %v", ids)
	}
	// Retention saw it stopped before its cutoff, but it was stopped again after the cutoff (a
	// resume and a stop in between): the delete is refused, and so it is for a running sandbox.
	cutoff := later.Add(-time.Second)
	if _, err := s.Transition(ctx, "lease", rec.ID, store.Transition{
		From: []string{"stopped"}, To: "deleting", IfStoppedBy: cutoff}); !errors.Is(err, store.ErrWrongState) {
		t.Fatalf("retention delete of a sandbox stopped after the cutoff: want refused, got %v", err)
	}
	// SetTTL 0 on a running sandbox removes its deadline.
	s.Transition(ctx, "lease", rec.ID, store.Transition{From: []string{"stopped"}, To: "running"})
	if l, err := s.SetTTL(ctx, "lease", rec.ID, 0); err != nil || !l.ExpiresAt.IsZero() {
		t.Fatalf("ttl 0: %v %+v", err, l)
	}
	if ids, _ := s.Expired(ctx, "lease", later.Add(time.Hour), 10); len(ids) != 0 {
		t.Fatalf("no-lease sandbox in deadlines: %v", ids)
	}
}

func testList(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	const n = 23
	for i := 0; i < n; i++ {
		tags := map[string]string{"team": "a"}
		if i%2 == 0 {
			tags["even"] = "yes"
		}
		r := newRecord("lister", fmt.Sprintf("sb-%02d", i), tags)
		r.CreatedAt = t0.Add(time.Duration(i/5) * time.Millisecond) // ties on purpose
		if _, _, err := s.CreateOrReuse(ctx, r, true); err != nil {
			t.Fatal(err)
		}
		if i%3 == 0 {
			s.Transition(ctx, "lister", r.ID, store.Transition{From: []string{"provisioning"}, To: "running"})
		}
	}
	collect := func(f store.Filter, limit int) []string {
		var names []string
		cursor := ""
		for pages := 0; pages < 100; pages++ {
			p, err := s.List(ctx, "lister", f, limit, cursor)
			if err != nil {
				t.Fatal(err)
			}
			if len(p.Records) > limit {
				t.Fatalf("page of %d over limit %d", len(p.Records), limit)
			}
			for _, r := range p.Records {
				names = append(names, r.Name)
			}
			if p.Next == "" {
				return names
			}
			cursor = p.Next
		}
		t.Fatal("pagination does not end")
		return nil
	}
	uniq := func(names []string) int {
		m := map[string]bool{}
		for _, n := range names {
			m[n] = true
		}
		return len(m)
	}
	for _, tc := range []struct {
		f    store.Filter
		want int
	}{
		{store.Filter{}, n},
		{store.Filter{Tags: map[string]string{"team": "a"}}, n},
		{store.Filter{Tags: map[string]string{"team": "a", "even": "yes"}}, 12},
		{store.Filter{Statuses: []string{"running"}}, 8},
		{store.Filter{Tags: map[string]string{"even": "yes"}, Statuses: []string{"running"}}, 4},
		{store.Filter{Tags: map[string]string{"team": "b"}}, 0},
	} {
		for _, limit := range []int{1, 4, 100} {
			got := collect(tc.f, limit)
			if len(got) != tc.want || uniq(got) != tc.want {
				t.Errorf("filter %+v limit %d: got %d (%d unique), want %d", tc.f, limit, len(got), uniq(got), tc.want)
			}
		}
	}
	if _, err := s.List(ctx, "lister", store.Filter{}, 10, "garbage!"); !errors.Is(err, store.ErrBadCursor) {
		t.Fatalf("bad cursor: %v", err)
	}
}

func testDelete(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	rec := newRecord("del", "gone", map[string]string{"k": "v"})
	s.CreateOrReuse(ctx, rec, true)
	r, err := s.Transition(ctx, "del", "gone", store.Transition{From: []string{"provisioning", "running", "stopped", "failed"}, To: "deleting"})
	if err != nil || r.Gen != 2 {
		t.Fatalf("deleting: %v gen=%d", err, r.Gen)
	}
	if _, err := s.Get(ctx, "del", "gone"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("name still resolves while deleting: %v", err)
	}
	// The name is free again at once; the old record is still there by id until purged.
	fresh := newRecord("del", "gone", nil)
	if _, out, err := s.CreateOrReuse(ctx, fresh, true); err != nil || out != protocol.OutcomeCreated {
		t.Fatalf("recreate: %v %v", out, err)
	}
	if err := s.Purge(ctx, r); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, "del", rec.ID); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("purged record still there: %v", err)
	}
	if recs, _ := s.ListAll(ctx, "del", store.Filter{Tags: map[string]string{"k": "v"}}); len(recs) != 0 {
		t.Fatalf("tag index keeps a purged record: %v", recs)
	}
	if err := s.Purge(ctx, fresh); !errors.Is(err, store.ErrWrongState) {
		t.Fatalf("purge of a live record must refuse: %v", err)
	}
}

func testAPIKeys(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	key, k, err := s.CreateAPIKey(ctx, "keys", "ci", t0)
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.Authenticate(ctx, key)
	if err != nil || got.Org != "keys" || got.ID != k.ID {
		t.Fatalf("authenticate: %v %+v", err, got)
	}
	raw, _ := store.Raw(s).HGetAll(ctx, store.APIKeyKey(k.ID)).Result()
	for f, v := range raw {
		if v == key || (len(v) > 20 && len(key) > 20 && v == key[len(key)-20:]) {
			t.Fatalf("field %s stores the key in clear", f)
		}
	}
	flipped := key[:len(key)-1] + map[bool]string{true: "B", false: "A"}[key[len(key)-1] == 'A']
	for _, bad := range []string{"", "sbk_", key + "x", flipped, "sbk_" + k.ID + "_" + "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "Bearer " + key} {
		if _, err := s.Authenticate(ctx, bad); !errors.Is(err, store.ErrBadKey) {
			t.Errorf("authenticate %q: want ErrBadKey, got %v", bad, err)
		}
	}
	if _, err := s.RevokeAPIKey(ctx, k.ID, t0); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Authenticate(ctx, key); !errors.Is(err, store.ErrBadKey) {
		t.Fatalf("revoked key still works: %v", err)
	}
	if _, _, err := s.CreateAPIKey(ctx, "Bad Org", "x", t0); !errors.Is(err, store.ErrInvalidOrg) {
		t.Fatalf("bad org: %v", err)
	}
	keys, _ := s.ListAPIKeys(ctx, "")
	if len(keys) != 1 || keys[0].RevokedAt.IsZero() {
		t.Fatalf("list: %+v", keys)
	}
}

// The embedded default keeps records across a restart of its redis-server on the same data dir.
func TestEmbeddedSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx := context.Background()
	e, err := store.StartEmbedded(ctx, dir, log)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewUniversalClient(e.Options())
	rec := newRecord("persist", "keepme", nil)
	if _, _, err := store.New(c).CreateOrReuse(ctx, rec, true); err != nil {
		t.Fatal(err)
	}
	c.Close()
	e.Stop()

	e, err = store.StartEmbedded(ctx, dir, log)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Stop()
	c = redis.NewUniversalClient(e.Options())
	defer c.Close()
	got, err := store.New(c).Get(ctx, "persist", "keepme")
	if err != nil || got.ID != rec.ID {
		t.Fatalf("after restart: %v %+v", err, got)
	}
}

// A Redis that lost its script cache (restart, failover, SCRIPT FLUSH) still renews leases: the
// pipelined heartbeats resend the script itself to every node that answered NOSCRIPT.
func TestHeartbeatAfterScriptFlush(t *testing.T) {
	t.Parallel()
	rdb := redistest.StartCluster(t)
	s := store.NewWithOptions(rdb, store.Options{Clock: func() time.Time { return t0.Add(time.Second) }})
	ctx := t.Context()
	var names []string
	for i := 0; i < 8; i++ { // orgs spread over the cluster's nodes
		org := fmt.Sprintf("flush-%d", i)
		rec := newRecord(org, "dev", nil)
		if _, _, err := s.CreateOrReuse(ctx, rec, false); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Transition(ctx, org, "dev", store.Transition{From: []string{"provisioning"}, To: "running"}); err != nil {
			t.Fatal(err)
		}
		names = append(names, org)
	}
	beat := func() {
		t.Helper()
		var wg sync.WaitGroup
		for _, org := range names {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if l, err := s.Heartbeat(ctx, org, "dev"); err != nil || !l.ExpiresAt.Equal(t0.Add(31*time.Second)) {
					t.Errorf("heartbeat %s: %v %+v", org, err, l)
				}
			}()
		}
		wg.Wait()
	}
	beat()
	cc := rdb.(*redis.ClusterClient)
	if err := cc.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error { return c.ScriptFlush(ctx).Err() }); err != nil {
		t.Fatal(err)
	}
	beat()
}

// Expiry warnings are claimed once per deadline, in deadline order, and the ones already warned
// never hide the rest: with more due than one call takes, the next call takes the next ones.
func testExpiryWarnings(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	const org, n = "warn", 250
	for i := range n {
		rec := newRecord(org, fmt.Sprintf("w-%03d", i), nil)
		rec.TTL = time.Duration(30+i) * time.Second
		if _, _, err := s.CreateOrReuse(ctx, rec, true); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Transition(ctx, org, rec.ID, store.Transition{From: []string{"provisioning"}, To: "running"}); err != nil {
			t.Fatal(err)
		}
	}
	// A warning comes at most half a lease early: w-249 (279 s) is due from t0+139.5s.
	clk.Set(t0.Add(200 * time.Second))
	window := func() ([]store.Warning, error) {
		return s.WarnExpiring(ctx, org, time.Hour, 200)
	}
	first, err := window()
	if err != nil || len(first) != 200 || first[0].Name != "w-000" || !first[0].ExpiresAt.Equal(t0.Add(30*time.Second)) {
		t.Fatalf("first call: %v, %d warnings, first %+v", err, len(first), first[0])
	}
	second, err := window()
	if err != nil || len(second) != n-200 || second[0].Name != "w-200" {
		t.Fatalf("second call: %v, %d warnings, want the %d not yet warned", err, len(second), n-200)
	}
	if third, err := window(); err != nil || len(third) != 0 {
		t.Fatalf("third call: %v %d, want none (each deadline warns once)", err, len(third))
	}
	// A heartbeat moves w-000's deadline: the new one is warned about once more, when it is half a
	// lease away, not at once although the warning (1h) is longer than the lease (30s).
	if _, err := s.Heartbeat(ctx, org, "w-000"); err != nil {
		t.Fatal(err)
	}
	if again, err := window(); err != nil || len(again) != 0 {
		t.Fatalf("right after a heartbeat: %v %+v, want no warning", err, again)
	}
	clk.Set(t0.Add(215 * time.Second))
	again, err := window()
	if err != nil || len(again) != 1 || again[0].Name != "w-000" || !again[0].StopAt.Equal(t0.Add(230*time.Second)) {
		t.Fatalf("after a heartbeat: %v %+v", err, again)
	}
}

// batchers counts the goroutines sending heartbeat pipelines.
func batchers() int {
	buf := make([]byte, 1<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "store.(*leaseBatcher).run(")
}

// Close ends the goroutine New starts; heartbeats after it fail with ErrClosed at once instead of
// waiting on a sender that is gone. Not parallel: it counts goroutines.
func TestStoreClose(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	before := batchers()
	s := store.New(rdb)
	// Any answer of the script will do (this sandbox does not exist): it went through the sender.
	if _, err := s.Heartbeat(t.Context(), "acme", "dev"); err == nil || errors.Is(err, store.ErrClosed) {
		t.Fatalf("heartbeat of a missing sandbox: %v", err)
	}
	if got := batchers(); got != before+1 {
		t.Fatalf("%d heartbeat senders after New, want %d", got, before+1)
	}
	s.Close()
	if got := batchers(); got != before {
		t.Fatalf("%d heartbeat senders after Close, want %d: Close leaves its goroutine running", got, before)
	}
	if _, err := s.Heartbeat(t.Context(), "acme", "dev"); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("heartbeat after Close: %v, want ErrClosed", err)
	}
	s.Close() // twice is harmless
}

// testUIDs: two brokers (two Store values) on one Redis, racing, never hand out one uid twice; a
// full range is ErrUIDsExhausted; the skipped uid is never handed out; asking again for one sandbox
// answers its uid; a released uid comes back only after the rest of the range went round.
func testUIDs(t *testing.T, s *store.Store, clk *clock) {
	ctx := t.Context()
	other := store.New(store.Raw(s)) // a second broker on the same Redis
	r := store.UIDRange{First: 200000, Last: 200039, Skip: 200005}
	if r.Size() != 39 {
		t.Fatalf("size %d, want 39", r.Size())
	}
	var mu sync.Mutex
	got := map[int]string{}
	var wg sync.WaitGroup
	errs := make(chan error, 39)
	for i := range 39 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := s
			if i%2 == 1 {
				st = other
			}
			id := fmt.Sprintf("sb_%d", i)
			uid, err := st.AllocateUID(ctx, r, "o1", id)
			if err != nil {
				errs <- err
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if prev, dup := got[uid]; dup {
				errs <- fmt.Errorf("uid %d handed to %s and %s", uid, prev, id)
			}
			got[uid] = id
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if len(got) != 39 {
		t.Fatalf("%d distinct uids, want 39", len(got))
	}
	if _, ok := got[r.Skip]; ok {
		t.Errorf("the skipped uid %d was handed out", r.Skip)
	}
	for uid := range got {
		if uid < r.First || uid > r.Last {
			t.Errorf("uid %d outside %d-%d", uid, r.First, r.Last)
		}
	}
	if _, err := other.AllocateUID(ctx, r, "o1", "sb_extra"); !errors.Is(err, store.ErrUIDsExhausted) {
		t.Fatalf("allocation from a full range: %v, want ErrUIDsExhausted", err)
	}
	// The same sandbox asking again gets its own uid back, even with the range full.
	var uid0 int
	for uid, id := range got {
		if id == "sb_0" {
			uid0 = uid
		}
	}
	if again, err := s.AllocateUID(ctx, r, "o1", "sb_0"); err != nil || again != uid0 {
		t.Fatalf("second allocation for sb_0: %d, %v; want %d", again, err, uid0)
	}
	// Release is owner-checked and idempotent.
	if err := s.ReleaseUID(ctx, "o1", "sb_other"); err != nil {
		t.Fatal(err)
	}
	if owner, _ := s.UIDOwner(ctx, uid0); owner != "o1/sb_0" {
		t.Fatalf("a release by a sandbox that does not hold uid %d freed it (owner now %q)", uid0, owner)
	}
	for range 2 {
		if err := s.ReleaseUID(ctx, "o1", "sb_0"); err != nil {
			t.Fatal(err)
		}
	}
	if uid, err := other.AllocateUID(ctx, r, "o1", "sb_new"); err != nil || uid != uid0 {
		t.Fatalf("allocation after a release: %d, %v; want the freed %d", uid, err, uid0)
	}
	// A wider range: a released uid is not the next one handed out.
	wide := store.UIDRange{First: 300000, Last: 300009}
	a, _ := s.AllocateUID(ctx, wide, "o1", "sb_a")
	if err := s.ReleaseUID(ctx, "o1", "sb_a"); err != nil {
		t.Fatal(err)
	}
	if b, _ := s.AllocateUID(ctx, wide, "o1", "sb_b"); b == a {
		t.Errorf("uid %d was handed out again at once after its release", a)
	}
	// A reservation (files on disk that belong to a uid) holds it, unless another sandbox does.
	if got, err := s.ReserveUID(ctx, 300009, "o1", "sb_files"); err != nil || got != 300009 {
		t.Fatalf("reserve a free uid: %d, %v", got, err)
	}
	if owner, _ := s.UIDOwner(ctx, 300009); owner != "o1/sb_files" {
		t.Fatalf("reserved uid's owner: %q", owner)
	}
	if _, err := s.ReserveUID(ctx, 300009, "o1", "sb_intruder"); err == nil {
		t.Fatal("reserved a uid another sandbox holds")
	}
	// The uid is kept with the record.
	rec := newRecord("o1", "with-uid", nil)
	rec.UID = 300001
	if _, _, err := s.CreateOrReuse(ctx, rec, false); err != nil {
		t.Fatal(err)
	}
	if back, err := s.Get(ctx, "o1", rec.ID); err != nil || back.UID != 300001 {
		t.Fatalf("record uid %d, %v; want 300001", back.UID, err)
	}
}
