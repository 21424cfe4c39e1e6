package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
)

// get sends GET path with cred from the loopback address src (any 127.x.y.z is ours on Linux) and
// answers the status, the error code and Retry-After.
func get(t *testing.T, base, path, cred, src string) (int, string, string) {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{
		LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}).DialContext}}
	defer hc.CloseIdleConnections()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, base+path, nil)
	if cred != "" {
		req.Header.Set("Authorization", "Bearer "+cred)
	}
	if strings.HasSuffix(path, "/dataplane") {
		req.Header.Set("Sec-WebSocket-Protocol", protocol.Subprotocol)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var eb protocol.ErrorBody
	json.NewDecoder(resp.Body).Decode(&eb)
	return resp.StatusCode, eb.Error.Code, resp.Header.Get("Retry-After")
}

// Each credential gets its org's rps (a token bucket of burst) on this broker: past it, 429
// rate_limited with Retry-After; other credentials and other orgs are not slowed; an org's own limit
// reaches the broker within its cache time.
func TestRateLimitPerCredential(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC))
	b := servertest.New(t, servertest.Options{Now: clock.Now, Limits: store.Limits{RPS: 5, Burst: 5}})
	c, ctx := b.Client, t.Context()
	for i := range 5 {
		if _, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil {
			t.Fatalf("request %d of a burst of 5: %v", i+1, err)
		}
	}
	if _, err := c.ListSandboxes(ctx, client.ListOptions{}); code(err) != protocol.CodeRateLimited ||
		!strings.Contains(err.Error(), "retry in 1 s") || !strings.Contains(err.Error(), "broker orgs set-limits "+b.Org+" --rps") {
		t.Fatalf("the 6th request at once: %v", err)
	}
	status, errCode, after := get(t, b.URL, "/v1/sandboxes", c.APIKey(), "127.0.0.1")
	if status != 429 || errCode != protocol.CodeRateLimited || after != "1" {
		t.Fatalf("rate limited answer: %d %s Retry-After=%q", status, errCode, after)
	}
	// Another key of the same org, and another org, have their own buckets.
	if _, err := b.NewClient(b.Org).ListSandboxes(ctx, client.ListOptions{}); err != nil {
		t.Fatalf("another key of the org: %v", err)
	}
	if _, err := b.NewClient("other-org").ListSandboxes(ctx, client.ListOptions{}); err != nil {
		t.Fatalf("another org: %v", err)
	}
	// A second refills one token.
	clock.Advance(time.Second)
	if _, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil {
		t.Fatalf("after a second: %v", err)
	}
	// The org's own limit replaces the default once the broker reads it again.
	if err := b.Store.SetOrgLimits(ctx, b.Org, map[string]int{store.LimitRPS: 1000, store.LimitBurst: 1000}, nil); err != nil {
		t.Fatal(err)
	}
	clock.Advance(10 * time.Second)
	for i := range 50 {
		if _, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil {
			t.Fatalf("request %d under the org's own rps 1000: %v", i+1, err)
		}
	}
}

// Failed authentications per source: after N in the window, every request from that source is 429
// rate_limited with Retry-After, the same whether the key exists, is wrong or is right (no oracle);
// other sources are not affected; the window's end lets the source in again.
func TestFailedAuthPerSource(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC))
	b := servertest.New(t, servertest.Options{Now: clock.Now, AuthFailures: 20, AuthFailureWindow: time.Minute})
	_, k, err := b.Store.CreateAPIKey(context.Background(), b.Org, "victim", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	good := b.Client.APIKey()
	// 300 wrong keys at once, half naming an existing key id: 20 are 401, the rest 429.
	var wg sync.WaitGroup
	var mu sync.Mutex
	counts := map[int]int{}
	for i := range 300 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cred := "sbk_nosuchkey_" + strconv.Itoa(i)
			if i%2 == 0 {
				cred = "sbk_" + k.ID + "_wrongsecret" + strconv.Itoa(i)
			}
			status, errCode, after := get(t, b.URL, "/v1/sandboxes", cred, "127.0.0.7")
			mu.Lock()
			defer mu.Unlock()
			counts[status]++
			if status == 429 && (errCode != protocol.CodeRateLimited || after == "") {
				t.Errorf("429 without its code or Retry-After: %s %q", errCode, after)
			}
		}()
	}
	wg.Wait()
	if counts[401] != 20 || counts[429] != 280 {
		t.Fatalf("300 wrong keys: %v; want 20 x 401 and 280 x 429", counts)
	}
	// Blocked: a right key, a wrong key and an existing id with a wrong secret all get the same 429.
	for _, cred := range []string{good, "sbk_nosuchkey_x", "sbk_" + k.ID + "_wrong", ""} {
		status, errCode, after := get(t, b.URL, "/v1/sandboxes", cred, "127.0.0.7")
		if status != 429 || errCode != protocol.CodeRateLimited || after != "60" {
			t.Fatalf("blocked source with %.8q...: %d %s Retry-After=%q", cred, status, errCode, after)
		}
	}
	// The dataplane route is guarded too.
	if status, _, _ := get(t, b.URL, "/v1/sandboxes/x/dataplane", good, "127.0.0.7"); status != 429 {
		t.Fatalf("blocked source on the dataplane: %d", status)
	}
	// Another source is not affected, and health checks are never refused.
	if status, _, _ := get(t, b.URL, "/v1/sandboxes", good, "127.0.0.8"); status != 200 {
		t.Fatalf("another source: %d", status)
	}
	if status, _, _ := get(t, b.URL, "/healthz", "", "127.0.0.7"); status != 200 {
		t.Fatalf("healthz from a blocked source: %d", status)
	}
	// A revoked token retried is not a guess (the broker signed it): it never blocks its source,
	// which may be an agent server's host running other agents.
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	tok, err := b.Client.Delegate(ctx, "dev", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.Revoke(ctx, "dev", tok.JTI); err != nil {
		t.Fatal(err)
	}
	for range 25 {
		if status, errCode, _ := get(t, b.URL, "/v1/sandboxes/dev/dataplane", tok.Token, "127.0.0.9"); status != 401 || errCode != protocol.CodeTokenRevoked {
			t.Fatalf("revoked token: %d %s", status, errCode)
		}
	}
	if status, _, _ := get(t, b.URL, "/v1/sandboxes", good, "127.0.0.9"); status != 200 {
		t.Fatalf("a source retrying a revoked token must not be blocked: %d", status)
	}
	clock.Advance(30 * time.Second)
	if _, _, after := get(t, b.URL, "/v1/sandboxes", good, "127.0.0.7"); after != "30" {
		t.Fatalf("Retry-After half-way through the window: %q", after)
	}
	clock.Advance(31 * time.Second)
	if status, _, _ := get(t, b.URL, "/v1/sandboxes", good, "127.0.0.7"); status != 200 {
		t.Fatalf("after the window: %d", status)
	}
}

// A delegation token is rate limited like an API key: its dataplane upgrades spend its own bucket,
// so a delegate redialling in a loop gets 429 rate_limited and its owner's key is not slowed.
func TestRateLimitPerToken(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC))
	b := servertest.New(t, servertest.Options{Now: clock.Now, Limits: store.Limits{RPS: 3, Burst: 3}})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(ctx, "dev", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
	if err != nil {
		t.Fatal(err)
	}
	path := strings.TrimPrefix(m.Sandbox.DataplaneURL, strings.Replace(b.URL, "http", "ws", 1))
	var codes []string
	for range 4 {
		_, errCode, _ := get(t, b.URL, path, m.Token, "127.0.0.1")
		codes = append(codes, errCode)
	}
	// The first three are spent on the token's bucket (a plain GET is no upgrade, so each answers
	// a handshake error after the checks); the fourth is refused by the limiter first.
	if codes[3] != protocol.CodeRateLimited || codes[2] == protocol.CodeRateLimited {
		t.Fatalf("codes of four upgrades with one token at rps 3: %v, want the fourth %s", codes, protocol.CodeRateLimited)
	}
	// The owner's key has its own bucket (create and delegate spent two of its three): its third
	// request in the same instant still goes through.
	if _, err := b.Client.ListSandboxes(ctx, client.ListOptions{}); err != nil {
		t.Fatalf("owner request while the token is limited: %v", err)
	}
}

// A batch heartbeat costs its credential a request per 100 refs against its rps, not one for up to
// 1000: each ref is a renewal in the shared Redis, so a key sending full batches at its rate renewed
// a hundred times what its rps allows, enough to saturate Redis for every org. A batch never costs
// more than the burst, so that one can always pass.
func TestBatchHeartbeatsCostTheirRefs(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Limits: store.Limits{RPS: 1, Burst: 20}})
	refs := make([]string, 1000)
	for i := range refs {
		refs[i] = fmt.Sprint("gone-", i)
	}
	for i := range 2 {
		if _, err := b.Client.Heartbeats(t.Context(), refs); err != nil {
			t.Fatalf("batch %d of 1000 refs within a burst of 20: %v", i+1, err)
		}
	}
	if _, err := b.Client.Heartbeats(t.Context(), refs); code(err) != protocol.CodeRateLimited {
		t.Fatalf("a third batch of 1000 refs at rps 1, burst 20: %v, want rate_limited", err)
	}
}
