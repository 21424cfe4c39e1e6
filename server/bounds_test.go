package server_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

// requestSeries counts the sbx_http_requests_total series /metrics reports, and returns the
// longest line of the exposition.
func requestSeries(t *testing.T, url string) (int, int) {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	n, longest := 0, 0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "sbx_http_requests_total{") {
			n++
		}
		longest = max(longest, len(sc.Text()))
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return n, longest
}

// rawMethod sends one request with any method name and path (net/http's client refuses some of
// them), without credentials, and returns the status line's code.
func rawMethod(t *testing.T, addr, method, path string) int {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", method, path)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// Method names and paths are the caller's to choose, without credentials: neither may become a
// metric series (each one is kept for the life of the process) or an unbounded log line.
func TestUnknownMethodsAndRoutesAreBounded(t *testing.T) {
	t.Parallel()
	logs := &wait.Buffer{}
	b := servertest.New(t, servertest.Options{Log: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	addr := strings.TrimPrefix(b.URL, "http://")
	b.Client.ListSandboxes(t.Context(), client.ListOptions{})
	send := func(i int) {
		big := strings.Repeat("M", 64<<10) + fmt.Sprint(i)
		for _, r := range []struct{ method, path string }{
			{big, "/v1/sandboxes"},
			{big, "/v1/nope"},
			{"GET", "/v1/" + strings.Repeat("p", 64<<10) + fmt.Sprint(i)},
			{fmt.Sprintf("BREW%d", i), "/v1/sandboxes/sb_x/stop"},
		} {
			if st := rawMethod(t, addr, r.method, r.path); st < 400 || st >= 500 {
				t.Fatalf("%.20s %.40s: status %d, want a 4xx", r.method, r.path, st)
			}
		}
	}
	send(0)
	requestSeries(t, b.URL) // the scrape's own series, from here on
	before, _ := requestSeries(t, b.URL)
	for i := 1; i <= 20; i++ {
		send(i)
	}
	after, longest := requestSeries(t, b.URL)
	if after != before {
		t.Errorf("unknown methods and routes grew the request metric from %d to %d series", before, after)
	}
	if longest > 1024 {
		t.Errorf("a /metrics line is %d bytes long: a caller's method or path became a label", longest)
	}
	for _, line := range strings.Split(logs.String(), "\n") {
		if len(line) > 2048 {
			t.Fatalf("a log line is %d bytes long: %.200s", len(line), line)
		}
	}
	if !strings.Contains(logs.String(), `"method":"MMMM`) {
		t.Errorf("the access log no longer names unknown methods at all:\n%.2000s", logs.String())
	}
}

// sseEvents reads an SSE answer's events (their data) until n have come or the stream ends.
func sseEvents(t *testing.T, body io.Reader, n int) []protocol.Event {
	t.Helper()
	var out []protocol.Event
	sc := bufio.NewScanner(body)
	for len(out) < n && sc.Scan() {
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			var e protocol.Event
			if err := json.Unmarshal([]byte(data), &e); err != nil {
				t.Fatalf("event data is not JSON: %q", data)
			}
			out = append(out, e)
		}
	}
	return out
}

// A resume position is the caller's to choose: one that is no event id is a clear 400 with its own
// code, and one past the end of the log (the largest id Redis can hold among them) a reset event
// followed by new events, never a 500 and never a stream that silently swallows every later event.
func TestHostileLastEventIDs(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "ev"}); err != nil {
		t.Fatal(err)
	}
	key := b.Client.APIKey()
	get := func(path, lastID string, header bool) *http.Response {
		t.Helper()
		u := b.URL + path
		req, _ := http.NewRequestWithContext(ctx, "GET", u, nil)
		if header {
			req.Header.Set("Last-Event-ID", lastID)
		} else {
			req.URL.RawQuery = url.Values{"last_event_id": {lastID}}.Encode() + "&" + req.URL.RawQuery
		}
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	bad := []string{
		"garbage", "-1-0", "1--1", "1-2-3", "1-", "-1", "+1-0", "1-0 ", "0x10-0",
		"99999999999999999999-0", "0-99999999999999999999",
		strings.Repeat("9", 10000) + "-0",
	}
	for _, path := range []string{"/v1/events?follow=false", "/v1/events", "/v1/sandboxes/ev/events?follow=false", "/v1/sandboxes/ev/events"} {
		for _, id := range bad {
			for _, header := range []bool{true, false} {
				if header && strings.ContainsAny(id, " ") {
					continue // a header value's spaces are trimmed in transit
				}
				resp := get(path, id, header)
				raw, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				var eb protocol.ErrorBody
				json.Unmarshal(raw, &eb)
				if resp.StatusCode != 400 || eb.Error.Code != protocol.CodeInvalidEventID || len(raw) > 1024 {
					t.Errorf("%s Last-Event-ID %.30q (header %v): %d %.300s, want 400 %s", path, id, header, resp.StatusCode, raw, protocol.CodeInvalidEventID)
				}
			}
		}
	}
	// Positions past the end of the log, the largest id there is among them.
	for _, id := range []string{"18446744073709551615-18446744073709551615", "18446744073709551615-0", "99999999999999-5"} {
		resp := get("/v1/events?follow=false", id, true)
		evs := sseEvents(t, resp.Body, 10)
		resp.Body.Close()
		if resp.StatusCode != 200 || len(evs) == 0 || evs[0].Type != protocol.EventReset {
			t.Fatalf("history after %s: %d %+v, want a reset", id, resp.StatusCode, evs)
		}
		resp = get("/v1/sandboxes/ev/events", id, true)
		if resp.StatusCode != 200 {
			t.Fatalf("follow after %s: %d", id, resp.StatusCode)
		}
		ready := make(chan []protocol.Event, 1)
		go func() { ready <- sseEvents(t, resp.Body, 2) }()
		// The reset comes first; then the stream goes on with new events.
		if _, err := b.Client.StopSandbox(ctx, "ev"); err != nil {
			t.Fatal(err)
		}
		b.Client.ResumeSandbox(ctx, "ev")
		select {
		case evs := <-ready:
			if len(evs) != 2 || evs[0].Type != protocol.EventReset || evs[1].Type == protocol.EventReset {
				t.Fatalf("follow after %s: %+v, want a reset then new events", id, evs)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("follow after %s: no events: the stream swallows everything after a position past its end", id)
		}
		resp.Body.Close()
	}
}

// A query is read whole or refused: past 10,000 parameters Go's parser drops them all, which
// turned a filtered list into every sandbox (and a filtered batch delete into an unfiltered one
// but for its own check), and a misspelled or repeated parameter must not be quietly ignored.
func TestQueryIsReadWholeOrRefused(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	for _, n := range []string{"mine", "other"} {
		if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: n, Tags: map[string]string{"who": n}}); err != nil {
			t.Fatal(err)
		}
	}
	key := b.Client.APIKey()
	status, _, raw := rawRequest(t, "GET", b.URL+"/v1/sandboxes?tag=who=mine", key, "")
	if status != 200 || !strings.Contains(string(raw), `"mine"`) || strings.Contains(string(raw), `"other"`) {
		t.Fatalf("filtered list: %d %s", status, raw)
	}
	padding := strings.Repeat("&x", 10001)
	cases := []struct{ name, method, path, code, says string }{
		{"over 10,000 parameters", "GET", "/v1/sandboxes?tag=who=mine" + padding, "invalid_argument", "parameters"},
		{"just over our bound", "GET", "/v1/sandboxes?tag=who=mine" + strings.Repeat("&status=running", 256), "invalid_argument", "parameters"},
		{"semicolon", "GET", "/v1/sandboxes?tag=who=mine;status=stopped", "invalid_argument", "semicolon"},
		{"bad escape", "GET", "/v1/sandboxes?tag=who=mine&status=%zz", "invalid_argument", "escape"},
		{"unknown parameter", "GET", "/v1/sandboxes?tags=who=mine", "invalid_argument", "tag, status, limit, cursor"},
		{"limit twice", "GET", "/v1/sandboxes?limit=1&limit=500", "invalid_argument", "once"},
		{"cursor twice", "GET", "/v1/sandboxes?cursor=a&cursor=b", "invalid_argument", "once"},
		{"one tag two values", "GET", "/v1/sandboxes?tag=who=mine&tag=who=other", "invalid_tag", "twice"},
		{"batch delete, over 10,000", "DELETE", "/v1/sandboxes?tag=who=mine" + padding, "invalid_argument", "parameters"},
		{"batch delete, misspelled dry run", "DELETE", "/v1/sandboxes?tag=who=mine&dryrun=true", "invalid_argument", "dry_run"},
		{"batch delete, dry run twice", "DELETE", "/v1/sandboxes?tag=who=mine&dry_run=true&dry_run=false", "invalid_argument", "once"},
		{"delete one with a dry run", "DELETE", "/v1/sandboxes/mine?dry_run=true", "invalid_argument", "no query parameters"},
		{"events, unknown", "GET", "/v1/events?follow=false&lastEventId=1-0", "invalid_argument", "last_event_id"},
		{"limits of another org", "GET", "/v1/limits?org=other", "invalid_argument", "no query parameters"},
	}
	for _, tc := range cases {
		before := b.RedisSnapshot()
		status, eb, raw := rawRequest(t, tc.method, b.URL+tc.path, key, "")
		if status != 400 || eb.Error.Code != tc.code || !strings.Contains(eb.Error.Message, tc.says) || len(raw) > 1024 {
			t.Errorf("%s: %d %.300s, want 400 %s saying %q", tc.name, status, raw, tc.code, tc.says)
		}
		if after := b.RedisSnapshot(); !maps.Equal(before, after) {
			t.Errorf("%s: a refused request changed Redis", tc.name)
		}
	}
	// Repeatable parameters still repeat, and one selector given twice is one selector.
	status, _, raw = rawRequest(t, "GET", b.URL+"/v1/sandboxes?tag=who=mine&tag=who=mine&status=running&status=stopped", key, "")
	if status != 200 || !strings.Contains(string(raw), `"mine"`) || strings.Contains(string(raw), `"other"`) {
		t.Fatalf("repeated selectors: %d %s", status, raw)
	}
}

// The dataplane_url handed out is built by one function from the hosting broker's base URL,
// whatever case its scheme was registered in (here by an older broker hosting the sandbox).
func TestDataplaneURLFromAnyCaseScheme(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dp"})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.RDB.HSet(ctx, store.SandboxKey(b.Org, res.Sandbox.ID), "node", "node-old").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Store.RegisterNode(ctx, "node-old", "HTTPS://Broker.example:8443"); err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(ctx, "dp", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	if want := "wss://Broker.example:8443/v1/sandboxes/" + res.Sandbox.ID + "/dataplane"; m.Sandbox.DataplaneURL != want {
		t.Fatalf("dataplane_url %q, want %q", m.Sandbox.DataplaneURL, want)
	}
}

// /metrics reports the gvisor bridges' discarded frames (a relay or bridge defect, each logged), so
// an operator can alert on a count that should stay 0.
func TestMetricsReportRelayDiscards(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	resp, err := http.Get(b.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	want := fmt.Sprintf("sbx_gvisor_relay_discarded_frames_total %d\n", sandbox.GvisorRelayDiscards())
	if !strings.Contains(string(raw), want) {
		t.Errorf("/metrics lacks %q", strings.TrimSpace(want))
	}
}
