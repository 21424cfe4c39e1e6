package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
)

// rawPost sends an owner request outside the SDK, to read the headers of the answer.
func rawPost(t *testing.T, b *servertest.Broker, c *client.Client, path string, body any) (*http.Response, protocol.ErrorBody) {
	t.Helper()
	raw, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, b.URL+path, bytes.NewReader(raw))
	req.Header.Set("Authorization", "Bearer "+c.APIKey())
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var eb protocol.ErrorBody
	json.NewDecoder(resp.Body).Decode(&eb)
	return resp, eb
}

// An org's sandboxes provisioning or running are bounded by max_running, on racing creates and
// resumes alike; a refusal is 429 quota_exceeded with Retry-After, says the limit and how to raise
// it, and changes nothing; reuse of a running sandbox is not refused; other orgs are not affected.
func TestMaxRunningQuota(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Limits: store.Limits{MaxRunning: 2}})
	c, ctx := b.Client, t.Context()

	// Eight racing creates of different names: exactly two get in.
	var wg sync.WaitGroup
	var mu sync.Mutex
	created, refused := []string{}, 0
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("race-%d", i)
			_, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name})
			mu.Lock()
			defer mu.Unlock()
			switch code(err) {
			case "":
				created = append(created, name)
			case protocol.CodeQuotaExceeded:
				refused++
			default:
				t.Errorf("create %s: %v", name, err)
			}
		}()
	}
	wg.Wait()
	if len(created) != 2 || refused != 6 {
		t.Fatalf("max_running 2: %d created (%v), %d refused; want 2 and 6", len(created), created, refused)
	}
	all, err := c.ListAllSandboxes(ctx, client.ListOptions{})
	if err != nil || len(all) != 2 {
		t.Fatalf("refused creates must leave no record: %v %d sandboxes", err, len(all))
	}

	// The answer: 429, Retry-After, the limit and how to raise it; nothing changed in Redis.
	before := b.RedisSnapshot()
	resp, eb := rawPost(t, b, c, "/v1/sandboxes", protocol.CreateSandboxRequest{Name: "one-more"})
	if resp.StatusCode != 429 || eb.Error.Code != protocol.CodeQuotaExceeded || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("over the limit: %d %+v Retry-After=%q", resp.StatusCode, eb, resp.Header.Get("Retry-After"))
	}
	for _, want := range []string{"max_running", "2", "broker orgs set-limits " + b.Org + " --max-running"} {
		if !strings.Contains(eb.Error.Message, want) {
			t.Errorf("message %q lacks %q", eb.Error.Message, want)
		}
	}
	if after := b.RedisSnapshot(); len(after) != len(before) {
		t.Errorf("a refused create changed Redis: %d keys before, %d after", len(before), len(after))
	}

	// Reusing a running sandbox at the limit is fine: it takes no new place.
	if res, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: created[0]}); err != nil || res.Outcome != "reused" {
		t.Fatalf("reuse at the limit: %v %+v", err, res)
	}

	// Stopping frees a place; a resume past the limit is refused, by resume and by create-reuse.
	if _, err := c.StopSandbox(ctx, created[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "third"}); err != nil {
		t.Fatalf("create after a stop: %v", err)
	}
	if _, err := c.ResumeSandbox(ctx, created[0]); code(err) != protocol.CodeQuotaExceeded {
		t.Fatalf("resume over the limit: %v", err)
	}
	if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: created[0]}); code(err) != protocol.CodeQuotaExceeded {
		t.Fatalf("create-reuse resuming over the limit: %v", err)
	}
	if sb, err := c.GetSandbox(ctx, created[0]); err != nil || sb.Status != protocol.StatusStopped {
		t.Fatalf("a refused resume must leave the sandbox stopped: %v %+v", err, sb)
	}

	// Two stopped sandboxes racing to resume into one free place: one wins.
	if _, err := c.StopSandbox(ctx, "third"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StopSandbox(ctx, created[1]); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "holder"}); err != nil {
		t.Fatal(err)
	}
	results := make(chan error, 2)
	for _, ref := range []string{"third", created[1]} {
		go func() { _, err := c.ResumeSandbox(ctx, ref); results <- err }()
	}
	ok := 0
	for range 2 {
		switch err := <-results; code(err) {
		case "":
			ok++
		case protocol.CodeQuotaExceeded:
		default:
			t.Fatalf("racing resume: %v", err)
		}
	}
	if ok != 1 {
		t.Fatalf("racing resumes into one place: %d succeeded, want 1", ok)
	}

	// The org's own limit beats the default; other orgs keep the default and their own count.
	if err := b.Store.SetOrgLimits(ctx, b.Org, map[string]int{store.LimitMaxRunning: 3}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ResumeSandbox(ctx, created[0]); err != nil {
		t.Fatalf("resume under the raised limit: %v", err)
	}
	lim, err := c.Limits(ctx)
	if err != nil || lim.Org != b.Org || lim.Limits.MaxRunning != 3 || lim.Usage.Running != 3 || len(lim.Own) != 1 || lim.Own[0] != "max_running" {
		t.Fatalf("GET /v1/limits: %v %+v", err, lim)
	}
	other := b.NewClient("other-org")
	for i := range 2 {
		if _, err := other.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: fmt.Sprint("o", i)}); err != nil {
			t.Fatalf("another org is not bound by this org's count: %v", err)
		}
	}
	if _, err := other.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "o3"}); code(err) != protocol.CodeQuotaExceeded {
		t.Fatalf("the other org keeps the default limit: %v", err)
	}

	// Deleting frees a place too.
	if _, err := other.DeleteSandbox(ctx, "o0"); err != nil {
		t.Fatal(err)
	}
	if _, err := other.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "o3"}); err != nil {
		t.Fatalf("create after a delete: %v", err)
	}
}

// The count survives a broker restart: sandboxes recorded before (or by an older broker, with no
// count at all) are counted from their records at start.
func TestMaxRunningRecount(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Limits: store.Limits{MaxRunning: 2}})
	c, ctx := b.Client, t.Context()
	for _, n := range []string{"a", "b"} {
		if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: n}); err != nil {
			t.Fatal(err)
		}
	}
	b.RDB.Del(ctx, store.ActiveKey(b.Org)) // what a broker from before the count left
	if err := b.Store.RecountRunning(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n, err := b.Store.Running(ctx, b.Org); err != nil || n != 2 {
		t.Fatalf("recount: %d %v, want 2", n, err)
	}
	if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "c"}); code(err) != protocol.CodeQuotaExceeded {
		t.Fatalf("after the recount the limit holds: %v", err)
	}
}

// An org's own connections limit replaces the broker's per-org dataplane cap: past it an upgrade
// is 429 too_many_connections naming the limit, other orgs keep the default, and /v1/limits shows it.
func TestOrgConnectionsLimit(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Dataplane: server.DataplaneLimits{PerOrg: 50}})
	ctx := t.Context()
	if err := b.Store.SetOrgLimits(ctx, b.Org, map[string]int{store.LimitConnections: 2}, nil); err != nil {
		t.Fatal(err)
	}
	_, url := newSandbox(t, b, "few")
	for range 2 {
		dialRaw(t, url, b.Client.APIKey())
	}
	// Another key of the org: the org's cap, not the credential's, refuses it.
	status, retry, eb := dialRefusal(t, url, b.NewClient(b.Org).APIKey())
	if status != 429 || eb.Error.Code != protocol.CodeTooManyConnections || retry == "" ||
		!strings.Contains(eb.Error.Message, "--connections") {
		t.Fatalf("third connection of an org limited to 2: %d Retry-After %q %+v", status, retry, eb.Error)
	}
	other := b.NewClient("other-org")
	res, err := other.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "many"})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		dialRaw(t, dataplaneURL(b, res.Sandbox.ID), other.APIKey())
	}
	lim, err := b.Client.Limits(ctx)
	if err != nil || lim.Limits.Connections != 2 || !slices.Contains(lim.Own, store.LimitConnections) {
		t.Fatalf("limits: %+v %v, want connections 2 of the org's own", lim, err)
	}
	if lim, err := other.Limits(ctx); err != nil || lim.Limits.Connections != 50 {
		t.Fatalf("another org's limits: %+v %v, want the broker's per-org cap 50", lim, err)
	}
}

// max_sandboxes counts stopped sandboxes too (each keeps its files and a host uid): an org at it
// is refused a new one with 429 quota_exceeded naming the limit, changes nothing, and frees a
// place by deleting; reusing or resuming one it has is never refused by it.
func TestMaxSandboxesQuota(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Limits: store.Limits{MaxSandboxes: 2}})
	c, ctx := b.Client, t.Context()
	for _, name := range []string{"one", "two"} {
		if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.StopSandbox(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	before := b.RedisSnapshot()
	_, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "three"})
	if code(err) != protocol.CodeQuotaExceeded || !strings.Contains(err.Error(), "max_sandboxes") ||
		!strings.Contains(err.Error(), "--max-sandboxes") {
		t.Fatalf("a third sandbox of an org limited to 2, both stopped: %v", err)
	}
	if after := b.RedisSnapshot(); len(after) != len(before) {
		t.Fatalf("a refused create changed Redis: %d keys before, %d after", len(before), len(after))
	}
	if res, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "one"}); err != nil || res.Outcome != "resumed" {
		t.Fatalf("resuming one of its own by name at the limit: %+v %v", res, err)
	}
	if _, err := b.NewClient("other-org").CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "three"}); err != nil {
		t.Fatalf("another org: %v", err)
	}
	if _, err := c.DeleteSandbox(ctx, "two"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "three"}); err != nil {
		t.Fatalf("after a delete: %v", err)
	}
}
