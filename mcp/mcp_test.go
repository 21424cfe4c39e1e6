package mcp_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/mcp"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

func TestMain(m *testing.M) { servertest.Main(m) }

type fixture struct {
	b   *servertest.Broker
	sbx protocol.Sandbox
}

func newFixture(t testing.TB) *fixture { return newFixtureWith(t, servertest.Options{}) }

func newFixtureWith(t testing.TB, o servertest.Options) *fixture {
	t.Helper()
	b := servertest.New(t, o)
	res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "mcp"})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{b: b, sbx: res.Sandbox}
}

func (f *fixture) mint(t *testing.T, scopes []string, allow ...string) protocol.MintResponse {
	t.Helper()
	m, err := f.b.Client.Delegate(t.Context(), f.sbx.ID, protocol.MintRequest{Scopes: scopes, AllowCmd: allow})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

type bearerTransport struct{ token string }

func (b bearerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return http.DefaultTransport.RoundTrip(r)
}

func (f *fixture) mcpURL() string { return f.b.URL + "/v1/sandboxes/" + f.sbx.ID + "/mcp" }

// connect opens an MCP session over Streamable HTTP with token.
func (f *fixture) connect(t testing.TB, token string, opts *sdk.ClientOptions) *sdk.ClientSession {
	t.Helper()
	c := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "v0"}, opts)
	cs, err := c.Connect(t.Context(), &sdk.StreamableClientTransport{Endpoint: f.mcpURL(),
		HTTPClient: &http.Client{Transport: bearerTransport{token}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

func toolNames(t *testing.T, cs *sdk.ClientSession) []string {
	t.Helper()
	res, err := cs.ListTools(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tl := range res.Tools {
		names = append(names, tl.Name)
	}
	slices.Sort(names)
	return names
}

func call(t *testing.T, cs *sdk.ClientSession, name string, args any) *sdk.CallToolResult {
	t.Helper()
	res, err := cs.CallTool(t.Context(), &sdk.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return res
}

func text(r *sdk.CallToolResult) string {
	var b strings.Builder
	for _, c := range r.Content {
		if tc, ok := c.(*sdk.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

func structured(t *testing.T, r *sdk.CallToolResult) string {
	t.Helper()
	b, err := json.Marshal(r.StructuredContent)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// A token lists exactly the tools of its scopes.
func TestToolsPerScope(t *testing.T) {
	f := newFixture(t)
	read := []string{"glob", "grep", "ls", "read_file"}
	for _, tc := range []struct {
		scopes []string
		want   []string
	}{
		{[]string{"fs:read"}, read},
		{[]string{"fs:write"}, []string{"edit_file", "write_file"}},
		{[]string{"exec"}, []string{"execute"}},
		{[]string{"fs:read", "exec"}, append(slices.Clone(read), "execute")},
		{[]string{"fs:read", "fs:write", "exec"}, []string{"edit_file", "execute", "glob", "grep", "ls", "read_file", "write_file"}},
	} {
		cs := f.connect(t, f.mint(t, tc.scopes).Token, nil)
		got := toolNames(t, cs)
		want := slices.Clone(tc.want)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("scopes %v: tools %v, want %v", tc.scopes, got, want)
		}
	}
}

// Every tool works, its structured result is the dataplane's result for the same operation, and
// each call shows in the sandbox's events under the token's jti.
func TestEveryToolMatchesDataplane(t *testing.T) {
	f := newFixture(t)
	m := f.mint(t, protocol.Scopes)
	cs := f.connect(t, m.Token, nil)
	dp, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()

	w := call(t, cs, "write_file", map[string]any{"file_path": "src/a.txt", "content": "one\ntwo\nthree\ntwo\n"})
	if w.IsError || !strings.Contains(structured(t, w), `"path":"/workspace/src/a.txt"`) {
		t.Fatalf("write_file: %s %s", text(w), structured(t, w))
	}
	r := call(t, cs, "read_file", map[string]any{"file_path": "/workspace/src/a.txt", "offset": 1, "limit": 2})
	direct, err := dp.Call(t.Context(), protocol.OpRead, protocol.ReadArgs{Path: "/workspace/src/a.txt", LineOffset: 1, LineLimit: 2})
	if err != nil {
		t.Fatal(err)
	}
	if got := structured(t, r); !sameJSON(got, string(direct)) {
		t.Errorf("read_file structured content\n%s\nwant the dataplane's\n%s", got, direct)
	}
	if text(r) != "two\nthree\n" {
		t.Errorf("read_file text %q", text(r))
	}
	e := call(t, cs, "edit_file", map[string]any{"file_path": "src/a.txt", "old_string": "two", "new_string": "2"})
	if !e.IsError || !strings.Contains(text(e), "2 times") && !strings.Contains(text(e), "not_unique") && !strings.Contains(text(e), "occurs") {
		t.Errorf("edit_file of a repeated string without replace_all: %v %s", e.IsError, text(e))
	}
	e = call(t, cs, "edit_file", map[string]any{"file_path": "src/a.txt", "old_string": "two", "new_string": "2", "replace_all": true})
	if e.IsError || !strings.Contains(structured(t, e), `"occurrences":2`) {
		t.Errorf("edit_file replace_all: %s", structured(t, e))
	}
	ls := call(t, cs, "ls", map[string]any{"path": "src"})
	if !strings.Contains(text(ls), "/workspace/src/a.txt") {
		t.Errorf("ls: %s", text(ls))
	}
	g := call(t, cs, "glob", map[string]any{"pattern": "**/*.txt"})
	if !strings.Contains(text(g), "/workspace/src/a.txt") {
		t.Errorf("glob: %s", text(g))
	}
	gr := call(t, cs, "grep", map[string]any{"pattern": "three"})
	if !strings.Contains(text(gr), "/workspace/src/a.txt:3:three") {
		t.Errorf("grep: %s", text(gr))
	}
	x := call(t, cs, "execute", map[string]any{"command": "cat src/a.txt; echo oops >&2; exit 3"})
	var xr protocol.ExecResult
	if err := json.Unmarshal([]byte(structured(t, x)), &xr); err != nil || xr.ExitCode != 3 || *xr.Stdout != "one\n2\nthree\n2\n" || *xr.Stderr != "oops\n" {
		t.Errorf("execute: %s", structured(t, x))
	}
	if !strings.Contains(text(x), "[exit code 3]") {
		t.Errorf("execute text: %q", text(x))
	}

	// The calls show in the events under the token's jti.
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var sawWrite, sawExec bool
	// Followed, not read once: an event reaches the log after the call that caused it answers.
	f.b.Client.Events(ctx, client.EventOptions{Ref: f.sbx.ID, Backlog: 100, Follow: true}, func(ev protocol.Event) error {
		if ev.Actor == "token:"+m.JTI && ev.Type == protocol.EventFileWritten && ev.Path == "/workspace/src/a.txt" {
			sawWrite = true
		}
		if ev.Actor == "token:"+m.JTI && ev.Type == protocol.EventExec && strings.HasPrefix(ev.Command, "cat src/a.txt") {
			sawExec = true
		}
		if sawWrite && sawExec {
			return errors.New("done")
		}
		return nil
	})
	if !sawWrite || !sawExec {
		t.Errorf("events attributed to token:%s: file_written %v, exec %v", m.JTI, sawWrite, sawExec)
	}
}

// An MCP session's events are a dataplane connection's: connected and disconnected under the
// token's jti, and for reads nothing else, as the dataplane does not event reads (docs/dataplane.md
// §7); calls that change files or run commands are evented (TestEveryToolMatchesDataplane).
func TestReadSessionEventsMatchDataplane(t *testing.T) {
	f := newFixture(t)
	viaMCP, viaDP := f.mint(t, protocol.Scopes), f.mint(t, protocol.Scopes)
	dp, err := backend.Dial(t.Context(), backend.Config{URL: viaDP.Sandbox.DataplaneURL, Credential: viaDP.Token})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dp.Call(t.Context(), protocol.OpWrite, protocol.WriteArgs{Path: "r.txt", Content: "x\n"}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		op   string
		args any
	}{{protocol.OpLs, protocol.LsArgs{Path: "/workspace"}}, {protocol.OpRead, protocol.ReadArgs{Path: "r.txt"}},
		{protocol.OpGlob, protocol.GlobArgs{Pattern: "*.txt"}}, {protocol.OpGrep, protocol.GrepArgs{Pattern: "x"}}} {
		if _, err := dp.Call(t.Context(), c.op, c.args); err != nil {
			t.Fatal(err)
		}
	}
	dp.Close()
	cs := f.connect(t, viaMCP.Token, nil)
	for name, args := range map[string]any{"ls": map[string]any{}, "read_file": map[string]any{"file_path": "r.txt"},
		"glob": map[string]any{"pattern": "*.txt"}, "grep": map[string]any{"pattern": "x"}} {
		if r := call(t, cs, name, args); r.IsError {
			t.Fatalf("%s: %s", name, text(r))
		}
	}
	cs.Close()

	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	types := map[string][]string{} // by jti
	ended := 0
	f.b.Client.Events(ctx, client.EventOptions{Ref: f.sbx.ID, Backlog: 100, Follow: true}, func(ev protocol.Event) error {
		if ev.JTI != viaMCP.JTI && ev.JTI != viaDP.JTI || ev.Type == protocol.EventTokenMinted { // minting is the owner's
			return nil
		}
		types[ev.JTI] = append(types[ev.JTI], ev.Type)
		if ev.Type == protocol.EventDisconnected {
			if ended++; ended == 2 {
				return errors.New("done")
			}
		}
		return nil
	})
	want := []string{protocol.EventConnected, protocol.EventDisconnected}
	if got := types[viaMCP.JTI]; !slices.Equal(got, want) {
		t.Errorf("a read-only MCP session's events under its jti: %v, want %v", got, want)
	}
	// The dataplane's write is evented; its reads are not.
	if got := types[viaDP.JTI]; !slices.Equal(got, []string{protocol.EventConnected, protocol.EventFileWritten, protocol.EventDisconnected}) {
		t.Errorf("the dataplane connection's events: %v", got)
	}
}

// A session's tool calls run on a dataplane connection of its token, counted like any: with a cap
// of one connection per credential, a WebSocket of the token keeps the session from opening its
// own (a tool error saying why, the session goes on), and the session's keeps the next WebSocket
// out until the session ends.
func TestSessionIsADataplaneConnection(t *testing.T) {
	f := newFixtureWith(t, servertest.Options{Dataplane: server.DataplaneLimits{PerCredential: 1}})
	m := f.mint(t, protocol.Scopes)
	dp, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		t.Fatal(err)
	}
	cs := f.connect(t, m.Token, nil)
	if r := call(t, cs, "ls", map[string]any{}); !r.IsError || !strings.Contains(text(r), protocol.CodeTooManyConnections) {
		t.Fatalf("a call while the token's one connection is a WebSocket: %v %s", r.IsError, text(r))
	}
	dp.Close()
	wait.Eventually(t, 10*time.Second, func() bool { return !call(t, cs, "ls", map[string]any{}).IsError },
		"the session's call after the WebSocket closed")
	_, err = backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err == nil || !strings.Contains(err.Error(), protocol.CodeTooManyConnections) {
		t.Fatalf("a WebSocket while the session holds the token's one connection: %v", err)
	}
	cs.Close()
	wait.Eventually(t, 10*time.Second, func() bool {
		r, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
		if err == nil {
			r.Close()
		}
		return err == nil
	}, "a WebSocket after the session ended")
}

// Bad input gets a JSON-RPC error and reaches no sandbox.
func TestBadInputIsJSONRPCError(t *testing.T) {
	f := newFixture(t)
	m := f.mint(t, protocol.Scopes)
	cs := f.connect(t, m.Token, nil)
	for _, tc := range []struct {
		name string
		args any
		want string
	}{
		{"write_file", map[string]any{"file_path": 7, "content": "x"}, "file_path must be a string"},
		{"write_file", map[string]any{"file_path": "a", "content": "x", "mode": "create"}, "unknown field"},
		{"read_file", map[string]any{"file_path": "a", "offset": "1"}, "offset must be an integer"},
		{"read_file", map[string]any{}, "file_path is required"},
		{"execute", map[string]any{"command": true}, "command must be a string"},
		{"write_file", map[string]any{"file_path": "big", "content": strings.Repeat("x", mcp.DefaultMaxArgBytes)}, "over this server's limit"},
		{"no_such_tool", map[string]any{}, "unknown tool"},
	} {
		_, err := cs.CallTool(t.Context(), &sdk.CallToolParams{Name: tc.name, Arguments: tc.args})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %v: error %v, want a JSON-RPC error containing %q", tc.name, tc.args, err, tc.want)
		}
	}
	ls := call(t, cs, "ls", map[string]any{})
	if strings.Contains(text(ls), "big") || strings.Contains(text(ls), "/workspace/a") {
		t.Errorf("a refused call changed the workspace: %s", text(ls))
	}
}

// A command outside the allowlist is refused with the allowlist's own error.
func TestAllowlistRefusal(t *testing.T) {
	f := newFixture(t)
	m := f.mint(t, []string{"exec"}, "echo")
	cs := f.connect(t, m.Token, nil)
	dp, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	_, derr := dp.Call(t.Context(), protocol.OpExec, protocol.ExecArgs{Command: "rm -rf /workspace"})
	var pe *protocol.Error
	if !errors.As(derr, &pe) || pe.Code != protocol.CodeCommandNotAllowed {
		t.Fatalf("dataplane: %v", derr)
	}
	r := call(t, cs, "execute", map[string]any{"command": "rm -rf /workspace"})
	if !r.IsError || text(r) != pe.Code+": "+pe.Message {
		t.Errorf("execute outside the allowlist: %v %q, want %q", r.IsError, text(r), pe.Code+": "+pe.Message)
	}
	ok := call(t, cs, "execute", map[string]any{"command": "echo hi"})
	if ok.IsError || !strings.HasPrefix(text(ok), "hi\n") {
		t.Errorf("allowed command: %s", text(ok))
	}
}

// Revoking the token ends the session: the next call fails with a clear error.
func TestRevokedTokenEndsSession(t *testing.T) {
	f := newFixture(t)
	m := f.mint(t, protocol.Scopes)
	cs := f.connect(t, m.Token, nil)
	call(t, cs, "ls", map[string]any{})
	if _, err := f.b.Client.Revoke(t.Context(), f.sbx.ID, m.JTI); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := cs.CallTool(t.Context(), &sdk.CallToolParams{Name: "ls", Arguments: map[string]any{}})
		if err != nil && strings.Contains(err.Error(), "token_revoked") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after revocation, a call answered %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// A new session with the revoked token is refused.
	c := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "v0"}, nil)
	_, err := c.Connect(t.Context(), &sdk.StreamableClientTransport{Endpoint: f.mcpURL(),
		HTTPClient: &http.Client{Transport: bearerTransport{m.Token}}}, nil)
	if err == nil || !strings.Contains(err.Error(), "token_revoked") {
		t.Errorf("a new session with a revoked token: %v", err)
	}
}

// A session opened on the token cache's answer by a broker that was not told of a revocation made
// since (written to Redis with no announcement, as by a broker whose announcement this one missed)
// ends within about delegation.RecentTTL of the revocation, not at its connection's 30 s re-check.
func TestSessionAdmittedOnACachedAnswerEnds(t *testing.T) {
	f := newFixture(t)
	m := f.mint(t, protocol.Scopes)
	call(t, f.connect(t, m.Token, nil), "ls", map[string]any{}) // reads the token's state: cached from here
	if err := f.b.Store.DenyToken(t.Context(), f.b.Org, m.JTI, time.Hour); err != nil {
		t.Fatal(err)
	}
	revoked := time.Now()
	cs := f.connect(t, m.Token, nil) // admitted on the cached answer
	if since := time.Since(revoked); since >= delegation.RecentTTL {
		t.Skipf("the session opened %s after the revocation, past the cache's bound: the test did not test", since)
	}
	var err error
	if !wait.Until(delegation.RecentTTL+5*time.Second, func() bool {
		_, err = cs.CallTool(t.Context(), &sdk.CallToolParams{Name: "ls", Arguments: map[string]any{}})
		return err != nil && strings.Contains(err.Error(), "token_revoked")
	}) {
		t.Fatalf("a session opened on a cached answer still answers %s after its token was revoked: %v", time.Since(revoked).Round(time.Second), err)
	}
	t.Logf("the session ended %s after the revocation", time.Since(revoked).Round(time.Millisecond))
}

// A revocation announced while the broker's subscription was cut (and it could not dial Redis to
// make it again) ends a session within a second or two of the reconnect, not at its connection's
// 30 s re-check. The broker's clock stands still, so that the session counts as admitted on a fresh
// answer and is not re-confirmed for a cached one (TestSessionAdmittedOnACachedAnswerEnds).
func TestSessionEndsOnResubscribeAfterAMissedRevocation(t *testing.T) {
	var refuse atomic.Bool
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		if refuse.Load() {
			return nil, errors.New("test: Redis unreachable")
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	f := newFixtureWith(t, servertest.Options{RedisDialer: dial, Now: servertest.NewClock(time.Now()).Now})
	m := f.mint(t, protocol.Scopes)
	cs := f.connect(t, m.Token, nil)
	call(t, cs, "ls", map[string]any{})
	direct := f.b.Redis.Client(t)
	refuse.Store(true)
	if n, err := direct.Do(t.Context(), "CLIENT", "KILL", "TYPE", "pubsub").Int(); err != nil || n == 0 {
		t.Fatalf("cutting the broker's subscriptions: %d cut, %v", n, err)
	}
	// Another broker's revocation, written and announced while this one hears nothing.
	other := store.NewWithOptions(direct, store.Options{})
	defer other.Close()
	if err := other.DenyToken(t.Context(), f.b.Org, m.JTI, time.Hour); err != nil {
		t.Fatal(err)
	}
	refuse.Store(false)
	back := time.Now()
	var err error
	if !wait.Until(5*time.Second, func() bool {
		_, err = cs.CallTool(t.Context(), &sdk.CallToolParams{Name: "ls", Arguments: map[string]any{}})
		return err != nil && strings.Contains(err.Error(), "token_revoked")
	}) {
		t.Fatalf("the session still answers %s after the broker could subscribe again: %v", time.Since(back).Round(time.Second), err)
	}
	t.Logf("the session ended %s after Redis was reachable again", time.Since(back).Round(time.Millisecond))
}

// Stopping the sandbox mid-session ends the session with not_running.
func TestSandboxStoppedMidSession(t *testing.T) {
	f := newFixture(t)
	m := f.mint(t, protocol.Scopes)
	cs := f.connect(t, m.Token, nil)
	call(t, cs, "ls", map[string]any{})
	if _, err := f.b.Client.StopSandbox(t.Context(), f.sbx.ID); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := cs.CallTool(t.Context(), &sdk.CallToolParams{Name: "ls", Arguments: map[string]any{}})
		if err != nil && strings.Contains(err.Error(), "not_running") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after stop, a call answered %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// An API key, a missing credential and another sandbox's token are refused before any MCP.
func TestEndpointRefusals(t *testing.T) {
	f := newFixture(t)
	other, err := f.b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "other"})
	if err != nil {
		t.Fatal(err)
	}
	om, err := f.b.Client.Delegate(t.Context(), other.Sandbox.ID, protocol.MintRequest{Scopes: protocol.Scopes})
	if err != nil {
		t.Fatal(err)
	}
	body := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"1"}}}`
	for _, tc := range []struct {
		auth   string
		status int
		code   string
	}{
		{"", 401, "unauthenticated"},
		{"Bearer " + f.b.Client.APIKey(), 403, "forbidden"},
		{"Bearer " + om.Token, 404, "not_found"},
		{"Bearer not.a.token", 401, ""},
	} {
		req, _ := http.NewRequest("POST", f.mcpURL(), strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var eb struct {
			ID    int `json:"id"`
			Error struct {
				Code int `json:"code"`
				Data struct {
					Code string `json:"code"`
				} `json:"data"`
			} `json:"error"`
		}
		json.NewDecoder(resp.Body).Decode(&eb)
		resp.Body.Close()
		if resp.StatusCode != tc.status || tc.code != "" && eb.Error.Data.Code != tc.code || eb.ID != 1 || eb.Error.Code != -32001 {
			t.Errorf("auth %.20q: %d %+v, want %d and a JSON-RPC error of id 1 with data.code %s", tc.auth, resp.StatusCode, eb, tc.status, tc.code)
		}
	}
}

// Concurrent calls on one session all complete; execute reports progress; cancelling a call
// cancels its command.
func TestConcurrentProgressCancel(t *testing.T) {
	f := newFixture(t)
	m := f.mint(t, protocol.Scopes)
	var mu sync.Mutex
	var progress []float64
	cs := f.connect(t, m.Token, &sdk.ClientOptions{ProgressNotificationHandler: func(_ context.Context, r *sdk.ProgressNotificationClientRequest) {
		mu.Lock()
		progress = append(progress, r.Params.Progress)
		mu.Unlock()
	}})
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := "c/" + string(rune('a'+i)) + ".txt"
			if _, err := cs.CallTool(t.Context(), &sdk.CallToolParams{Name: "write_file", Arguments: map[string]any{"file_path": p, "content": p}}); err != nil {
				errs <- err
				return
			}
			r, err := cs.CallTool(t.Context(), &sdk.CallToolParams{Name: "read_file", Arguments: map[string]any{"file_path": p}})
			if err != nil || text(r) != p {
				errs <- errors.New("read back " + text(r))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	params := &sdk.CallToolParams{Name: "execute", Arguments: map[string]any{"command": "sleep 1.5; echo done"}}
	params.SetProgressToken("p1")
	r2, err := cs.CallTool(t.Context(), params)
	if err != nil || !strings.HasPrefix(text(r2), "done\n") {
		t.Fatalf("execute with progress: %v %s", err, text(r2))
	}
	mu.Lock()
	n := len(progress)
	mu.Unlock()
	if n == 0 {
		t.Errorf("no progress notification during a 1.5 s command")
	}

	// Cancel: the command is killed, so it ends long before its sleep would and never finishes.
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: "execute", Arguments: map[string]any{"command": "touch started; sleep 30; touch finished"}})
		done <- err
	}()
	eventually(t, "the command started", func() bool {
		return strings.Contains(text(call(t, cs, "glob", map[string]any{"pattern": "started"})), "started")
	})
	cancel()
	if err := <-done; err == nil {
		t.Errorf("a cancelled call returned no error")
	}
	var ended *protocol.Event
	eventually(t, "the cancelled command's exec event", func() bool {
		ectx, ecancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer ecancel()
		f.b.Client.Events(ectx, client.EventOptions{Ref: f.sbx.ID, Backlog: 200}, func(ev protocol.Event) error {
			if ev.Type == protocol.EventExec && strings.HasPrefix(ev.Command, "touch started") {
				ended = &ev
				return errors.New("found")
			}
			return nil
		})
		return ended != nil
	})
	if ended.DurationMS == nil || *ended.DurationMS >= 30000 {
		t.Errorf("the cancelled command ran %v ms", ended.DurationMS)
	}
	if g := call(t, cs, "glob", map[string]any{"pattern": "finished"}); strings.Contains(text(g), "finished") {
		t.Errorf("the cancelled command ran to its end")
	}
}

// eventually polls cond until it holds, failing the test after 15 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 15 s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A POST that is not JSON, or not a message the server handles, gets a JSON-RPC error, and the
// stdio transport answers a line that is not JSON with one and goes on.
func TestMalformedMessages(t *testing.T) {
	f := newFixture(t)
	m := f.mint(t, protocol.Scopes)
	for _, tc := range []struct {
		body   string
		status int
		code   int
	}{
		{"{not json", 400, -32700},
		{`{"jsonrpc":"2.0","id":4,"method":"no/such/method"}`, 400, -32601},
		{`{"jsonrpc":"2.0","id":5,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"1"}},"extra":"` + strings.Repeat("x", mcp.DefaultMaxArgBytes+64<<10) + `"}`, 413, -32600},
	} {
		req, _ := http.NewRequest("POST", f.mcpURL(), strings.NewReader(tc.body))
		req.Header.Set("Authorization", "Bearer "+m.Token)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Mcp-Protocol-Version", "2025-06-18")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var msg struct {
			Error struct {
				Code int `json:"code"`
			} `json:"error"`
		}
		json.NewDecoder(resp.Body).Decode(&msg)
		resp.Body.Close()
		if resp.StatusCode != tc.status || msg.Error.Code != tc.code {
			t.Errorf("%.40s: %d %d, want %d and JSON-RPC error %d", tc.body, resp.StatusCode, msg.Error.Code, tc.status, tc.code)
		}
	}

	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	srv := mcp.NewServer(nil, mcp.Options{Scopes: []string{protocol.ScopeFSRead}})
	go srv.Run(t.Context(), mcp.StdioTransport(inR, outW))
	lines := bufio.NewScanner(outR)
	send := func(s string) { io.WriteString(inW, s+"\n") }
	send(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"1"}}}`)
	lines.Scan()
	send(`{"jsonrpc":"2.0","method":"notifications/initialized"}`)
	send(`{not json`)
	if !lines.Scan() || !strings.Contains(lines.Text(), `"code":-32700`) {
		t.Errorf("a line that is not JSON: %s", lines.Text())
	}
	send(`{"jsonrpc":"2.0","id":2,"method":"tools/list"}`)
	if !lines.Scan() || !strings.Contains(lines.Text(), `"id":2`) || !strings.Contains(lines.Text(), `"read_file"`) {
		t.Errorf("the session did not go on: %s", lines.Text())
	}
	inW.Close()
}

func sameJSON(a, b string) bool {
	var x, y any
	if json.Unmarshal([]byte(a), &x) != nil || json.Unmarshal([]byte(b), &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

// A session belongs to the token that opened it: another token of the same sandbox may not use it.
func TestSessionBoundToToken(t *testing.T) {
	f := newFixture(t)
	a, b := f.mint(t, protocol.Scopes), f.mint(t, protocol.Scopes)
	var sid string
	c := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "v0"}, nil)
	tr := &sdk.StreamableClientTransport{Endpoint: f.mcpURL(), HTTPClient: &http.Client{Transport: bearerTransport{a.Token}}}
	cs, err := c.Connect(t.Context(), tr, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	sid = cs.ID()
	req, _ := http.NewRequest("POST", f.mcpURL(), strings.NewReader(`{"jsonrpc":"2.0","id":7,"method":"tools/list"}`))
	req.Header.Set("Authorization", "Bearer "+b.Token)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Mcp-Session-Id", sid)
	req.Header.Set("Mcp-Protocol-Version", "2025-06-18")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var msg struct {
		ID    int `json:"id"`
		Error struct {
			Code int `json:"code"`
		} `json:"error"`
	}
	json.NewDecoder(resp.Body).Decode(&msg)
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || msg.ID != 7 || msg.Error.Code == 0 {
		t.Errorf("another token on the session: %d %+v, want 403 and a JSON-RPC error", resp.StatusCode, msg)
	}
	if _, err := cs.ListTools(t.Context(), nil); err != nil {
		t.Errorf("the session's own token: %v", err)
	}
}

// TestSessionsPerTokenBounded: a token holds at most the dataplane's connections per credential in
// MCP sessions at once. Each idle session holds the SDK's goroutine and buffers until it idles out
// (30 minutes): a delegate opening sessions at its request rate held hundreds of thousands. Past
// the bound an opening is refused with too_many_connections; ending a session frees its place, and
// another token is not affected.
func TestSessionsPerTokenBounded(t *testing.T) {
	f := newFixtureWith(t, servertest.Options{Dataplane: server.DataplaneLimits{PerCredential: 3}})
	m := f.mint(t, []string{protocol.ScopeFSRead})
	initialize := func(token string) (int, string, string) {
		req, _ := http.NewRequest("POST", f.mcpURL(), strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"1"}}}`))
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get("Mcp-Session-Id"), string(body)
	}
	end := func(token, sid string) {
		req, _ := http.NewRequest("DELETE", f.mcpURL(), nil)
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Mcp-Session-Id", sid)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	var sids []string
	for range 3 {
		status, sid, body := initialize(m.Token)
		if status != 200 || sid == "" {
			t.Fatalf("opening a session: %d %q %s", status, sid, body)
		}
		sids = append(sids, sid)
	}
	t.Cleanup(func() {
		for _, sid := range sids {
			end(m.Token, sid)
		}
	})
	status, _, body := initialize(m.Token)
	if status != http.StatusTooManyRequests || !strings.Contains(body, protocol.CodeTooManyConnections) {
		t.Fatalf("a fourth session: %d %s; want 429 too_many_connections", status, body)
	}
	other := f.mint(t, []string{protocol.ScopeFSRead})
	if status, sid, body := initialize(other.Token); status != 200 {
		t.Fatalf("another token: %d %s", status, body)
	} else {
		end(other.Token, sid)
	}
	end(m.Token, sids[0])
	sids = sids[1:]
	eventually(t, "a place freed by an ended session", func() bool {
		status, sid, _ := initialize(m.Token)
		if status == 200 {
			sids = append(sids, sid)
		}
		return status == 200
	})
}

// TestTruncatedGrepSaysTheSearchStopped: a grep a cap stopped (here glob's match-work budget, spent
// on names before any file was searched) with no match says that the search stopped before every
// file was searched, so that an agent does not read an empty answer as "the text is absent". It
// said only "(truncated)", which also means "more matches than max_count".
func TestTruncatedGrepSaysTheSearchStopped(t *testing.T) {
	f := newFixture(t)
	cs := f.connect(t, f.mint(t, []string{protocol.ScopeFSRead, protocol.ScopeExec}).Token, nil)
	// 6000 names of 200 bytes against a pattern of 4000 bytes spend more than the 2^32 budget.
	if r := call(t, cs, "execute", map[string]any{"command": "mkdir -p many && cd many && for i in $(seq 6000); do : > $(printf '%0200d' $i); done"}); r.IsError {
		t.Fatalf("making the files: %s", text(r))
	}
	gr := call(t, cs, "grep", map[string]any{"pattern": "needle", "path": "many", "glob": strings.Repeat("*", 4000) + "q"})
	if gr.IsError || !strings.Contains(structured(t, gr), `"truncated":true`) {
		t.Fatalf("grep over the glob budget: %s", structured(t, gr))
	}
	if got := text(gr); !strings.Contains(got, "stopped before every file was searched") {
		t.Fatalf("a truncated grep with no match says %q; want it to say the search did not finish", got)
	}
	// So does a glob that the same budget stopped before any path matched.
	g := call(t, cs, "glob", map[string]any{"pattern": strings.Repeat("*", 4000) + "q", "path": "many"})
	if got := text(g); !strings.Contains(got, "stopped before the whole tree was searched") {
		t.Fatalf("a truncated glob with no match says %q", got)
	}
	// More matches than max_count is truncated too, and says that more may exist.
	call(t, cs, "execute", map[string]any{"command": "printf 'x\\nx\\n' > two.txt"})
	gr = call(t, cs, "grep", map[string]any{"pattern": "x", "path": "two.txt", "max_count": 1})
	if got := text(gr); !strings.Contains(got, "two.txt:1:x") || !strings.Contains(got, "more matches may exist") {
		t.Fatalf("a grep cut at max_count says %q", got)
	}
}
