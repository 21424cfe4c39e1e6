package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

func dialToken(t *testing.T, b *servertest.Broker, name string, req protocol.MintRequest) (*backend.Remote, protocol.MintResponse) {
	t.Helper()
	b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: name})
	m, err := b.Client.Delegate(t.Context(), name, req)
	if err != nil {
		t.Fatal(err)
	}
	r, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r, m
}

func TestDataplaneSmoke(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	r, _ := dialToken(t, b, "dp", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	ctx := t.Context()
	if err := r.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "/workspace/a.txt", Content: "hello\nworld\n"}); err != nil {
		t.Fatal(err)
	}
	rr, err := r.Read(ctx, protocol.ReadArgs{Path: "a.txt", LineOffset: 1, LineLimit: 1})
	if err != nil || rr.Content != "world\n" || rr.TotalLines != 2 {
		t.Fatalf("read: %v %+v", err, rr)
	}
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "cat a.txt; echo err >&2; exit 3", Combined: true}})
	if err != nil || res.ExitCode != 3 || res.Output == nil || *res.Output != "hello\nworld\nerr\n" {
		t.Fatalf("exec: %v %+v", err, res)
	}
	var out bytes.Buffer
	res, err = r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "echo streamed"}, Stdout: &out})
	if err != nil || out.String() != "streamed\n" {
		t.Fatalf("stream: %v %+v %q", err, res, out.String())
	}
	big := bytes.Repeat([]byte("0123456789abcdef"), 300000) // 4.8 MB: several chunks
	if w, err := r.Upload(ctx, "big.bin", bytes.NewReader(big)); err != nil || w.Size != int64(len(big)) {
		t.Fatalf("upload: %v %+v", err, w)
	}
	var got bytes.Buffer
	if n, err := r.Download(ctx, "big.bin", &got); err != nil || n != int64(len(big)) || !bytes.Equal(got.Bytes(), big) {
		t.Fatalf("download: %v %d", err, n)
	}
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := r.Exec(cctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "sleep 30"}}); err == nil || time.Since(start) > 5*time.Second {
		t.Fatalf("cancel: %v after %s", err, time.Since(start))
	}
	if err := r.Ping(ctx); err != nil {
		t.Fatalf("connection unusable after a cancel: %v", err)
	}
	if _, err := r.Read(ctx, protocol.ReadArgs{Path: "../etc/passwd"}); !strings.Contains(code(err), "invalid_path") {
		t.Fatalf("escape: %v", err)
	}
}

// Many large answers that the client does not read hold a bounded amount of broker memory:
// operations with large answers take a heavy slot (two per connection) until their answer is
// written. Before this bound, 64 unread 8 MiB reads held about 1.9 GB; 64 of 4 MiB would hold
// well over the bound checked here.
func TestDataplaneLargeAnswersHoldBoundedMemory(t *testing.T) {
	// Not parallel: it measures this process's heap, which parallel tests would move.
	b := servertest.New(t, servertest.Options{})
	id, url := newSandbox(t, b, "mem")
	big := bytes.Repeat([]byte("0123456789abcdef"), 4<<20/16)
	if err := os.WriteFile(filepath.Join(workspaceDir(b, id), "big.txt"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, url, b.Client.APIKey())
	base := heapInuse()
	for i := 0; i < 64; i++ {
		c.sendJSON(protocol.Request{ID: uint32(10 + i), Op: "read", Args: map[string]any{"path": "big.txt"}})
	}
	// The broker has done what it will without the client reading once the connection's two
	// heavy slots are held by reads whose answers wait in its queue: the other 62 wait for a slot.
	// Without the bound the slots are never taken this way, and this fails.
	wait.Eventually(t, 20*time.Second, func() bool {
		u := server.Usage(b.Server)
		return u.HeavySlots == 2 && u.QueuedBytes > 0
	}, "two reads holding the connection's heavy slots with their answers queued")
	// From that steady state nothing more may grow; a read let past the bound loads 4 MiB at once,
	// so a second is far longer than one would take to show.
	wait.Never(t, time.Second, func() bool { return int64(heapInuse())-int64(base) > 150<<20 },
		"64 unread 4 MiB reads hold over 150 MiB of broker heap")
	for i := 0; i < 64; i++ {
		got := c.await(uint32(10 + i))
		var rr protocol.ReadResult
		if got.Error != nil || got.decode(&rr) != nil || rr.Size != int64(len(big)) {
			t.Fatalf("read %d: %s", i, got)
		}
	}
}

func TestDataplaneRefusesAnyQueryAndIDZero(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	_, url := newSandbox(t, b, "q")
	for _, q := range []string{"?Token=x", "?jwt=x", "?x=1", "?=x"} {
		d := websocket.Dialer{Subprotocols: []string{protocol.Subprotocol}}
		_, resp, err := d.Dial(url+q, authHeader(b.Client.APIKey()))
		if err == nil || resp == nil || resp.StatusCode != 400 {
			t.Errorf("%s: want 400, got %v %v", q, resp, err)
		}
	}
	c := dialRaw(t, url, b.Client.APIKey())
	c.sendJSON(protocol.Request{ID: 0, Op: "ping"})
	if got := c.await(0); got.code() != protocol.CodeInvalidArgument || !strings.Contains(got.Error.Message, "reserved") {
		t.Fatalf("id 0: %s", got)
	}
}

// Revoking an owner's API key closes its open dataplane connections at once, as revoking a token
// does (not only at the periodic re-check).
func TestDataplaneOwnerKeyRevocationClosesAtOnce(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	_, url := newSandbox(t, b, "own")
	key, k, _ := b.Store.CreateAPIKey(t.Context(), b.Org, "laptop", time.Now())
	c := dialRaw(t, url, key)
	c.ping()
	start := time.Now()
	b.Store.RevokeAPIKey(t.Context(), k.ID, time.Now())
	c.ws.SetReadDeadline(time.Now().Add(3 * time.Second))
	for {
		_, _, err := c.ws.ReadMessage()
		var ce *websocket.CloseError
		if errors.As(err, &ce) {
			if ce.Code != protocol.CloseCredentialEnded || ce.Text != protocol.CodeUnauthenticated || time.Since(start) > time.Second {
				t.Fatalf("closed with %d %q after %s", ce.Code, ce.Text, time.Since(start))
			}
			return
		}
		if err != nil {
			t.Fatalf("not closed with a close frame: %v", err)
		}
	}
}

// A cancelled command still shows in the owner's events, with its reason.
func TestDataplaneCancelledExecIsAnEvent(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	r, m := dialToken(t, b, "ev", protocol.MintRequest{Scopes: []string{"exec"}})
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "sleep 30"}})
	wait.Eventually(t, 5*time.Second, func() bool {
		for _, e := range sandboxEvents(t, b.Client, m.Sandbox.SandboxID) {
			if e.Type == protocol.EventExec && e.Command == "sleep 30" && e.Reason == "cancelled" && e.JTI == m.JTI {
				return true
			}
		}
		return false
	}, "an exec event with reason cancelled for the cancelled command")
}

// The Go client keeps within the broker's max_inflight: more concurrent calls wait, none is refused.
func TestRemoteQueuesBeyondMaxInflight(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	r, _ := dialToken(t, b, "many", protocol.MintRequest{Scopes: []string{"exec"}})
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for i := 0; i < 100; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := r.Exec(t.Context(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "sleep 0.2"}})
			if err == nil && res.ExitCode != 0 {
				err = errors.New("exit " + res.Signal)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("a call beyond max_inflight failed: %v", err)
		}
	}
}

// Downloads that their clients read slowly (here: never) hold no broker-wide slot: with as many of
// them as the broker has slots, another connection's reads are still answered.
func TestDataplaneSlowDownloadsDoNotStallReads(t *testing.T) {
	// Not parallel: the unread downloads hold their write queues, which heap tests would count.
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "slowdl")
	ws := workspaceDir(b, id)
	// 256 MiB, sparse: far more than any buffer on the way, so the downloads never end.
	f, err := os.Create(filepath.Join(ws, "huge.bin"))
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(256 << 20)
	f.Close()
	if err := os.WriteFile(filepath.Join(ws, "small.txt"), []byte("hi\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	key := b.Client.APIKey()
	var downloads []*rawConn
	for i := 0; i < 8; i++ { // two downloads each: sixteen, the broker-wide heavy slots
		c := dialRaw(t, url, key)
		c.sendJSON(protocol.Request{ID: 1, Op: "download", Args: map[string]any{"path": "huge.bin"}})
		c.sendJSON(protocol.Request{ID: 2, Op: "download", Args: map[string]any{"path": "huge.bin"}})
		downloads = append(downloads, c)
	}
	// Every download has started (a slot it took would be held now) once a chunk of each came:
	// reading a few chunks frees queue space the downloads refill at once, they never end.
	for i, c := range downloads {
		for len(c.bins[1]) == 0 || len(c.bins[2]) == 0 {
			if err := c.readOne(10 * time.Second); err != nil {
				t.Fatalf("connection %d: waiting for a chunk of both downloads: %v", i, err)
			}
		}
	}
	reader := dialRaw(t, url, key)
	reader.sendJSON(protocol.Request{ID: 1, Op: "read", Args: map[string]any{"path": "small.txt"}})
	if err := reader.readOne(5 * time.Second); err != nil {
		t.Fatalf("a read behind sixteen unread downloads on other connections: %v", err)
	}
	if got := reader.await(1); got.Error != nil {
		t.Fatalf("read: %s", got)
	}
}

// A request that is not a well-formed WebSocket upgrade gets the JSON error body of every other
// refusal, with the request id, not a plain-text "Bad Request".
func TestDataplaneBadUpgradeIsJSON(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, _ := newSandbox(t, b, "plain")
	cases := []struct {
		name    string
		hdr     map[string]string
		version bool // the answer names the version the server speaks
	}{
		{"plain GET", map[string]string{}, false},
		{"old WebSocket version", map[string]string{"Connection": "Upgrade", "Upgrade": "websocket",
			"Sec-WebSocket-Version": "8", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}, true},
	}
	for _, tc := range cases {
		req, _ := http.NewRequest("GET", b.URL+"/v1/sandboxes/"+id+"/dataplane", nil)
		req.Header.Set("Authorization", "Bearer "+b.Client.APIKey())
		req.Header.Set("Sec-WebSocket-Protocol", protocol.Subprotocol)
		for k, v := range tc.hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var eb protocol.ErrorBody
		err = json.NewDecoder(resp.Body).Decode(&eb)
		resp.Body.Close()
		if resp.StatusCode != 400 || err != nil || eb.Error.Code != protocol.CodeInvalidArgument || eb.Error.Message == "" ||
			eb.Error.RequestID == "" || eb.Error.RequestID != resp.Header.Get("X-Request-Id") {
			t.Errorf("%s: %d %+v (%v), want 400 invalid_argument with the request id", tc.name, resp.StatusCode, eb, err)
		}
		if tc.version && resp.Header.Get("Sec-WebSocket-Version") != "13" {
			t.Errorf("%s: Sec-WebSocket-Version %q, want 13", tc.name, resp.Header.Get("Sec-WebSocket-Version"))
		}
	}
}

// Token expiry at the upgrade is on the broker's clock, the one its connections end by: a token past
// exp on that clock is refused, though the wall clock (and the verifier's leeway) would accept it.
func TestDataplaneTokenExpiryOnBrokerClock(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Provider: "dir", Now: clock.Now})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "clocked"}); err != nil {
		t.Fatal(err)
	}
	ttl := int64(60)
	m, err := b.Client.Delegate(t.Context(), "clocked", protocol.MintRequest{Scopes: []string{"fs:read"}, TTLSeconds: &ttl})
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(70 * time.Second) // past exp, within the verifier's 30 s leeway
	status, eb := dialStatus(t, m.Sandbox.DataplaneURL, authHeader(m.Token), []string{protocol.Subprotocol})
	if status != 401 || eb.Error.Code != protocol.CodeTokenExpired {
		t.Errorf("token past exp on the broker's clock: %d %+v, want 401 token_expired", status, eb)
	}
}

// An exec the provider cannot run as given is invalid_argument with the provider's reason, in
// sandbox terms.
func TestDataplaneExecInvalidRequest(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "badexec")
	c := dialRaw(t, url, b.Client.APIKey())
	cases := []struct {
		name string
		args map[string]any
		want string // the whole message, or "" for any that names no host path
	}{
		{"bad env name", map[string]any{"command": "true", "env": map[string]string{"1BAD": "x"}}, `environment variable name "1BAD"`},
		{"missing cwd", map[string]any{"command": "true", "cwd": "no/such/dir"}, ""},
	}
	for i, tc := range cases {
		got := c.call(uint32(i+1), "exec", tc.args)
		if got.code() != protocol.CodeInvalidArgument || (tc.want != "" && got.Error.Message != tc.want) ||
			strings.Contains(got.Error.Message, b.DataDir) || strings.HasPrefix(got.Error.Message, "invalid exec request") {
			t.Errorf("%s: %s, want invalid_argument %q", tc.name, got, tc.want)
		}
	}
}

// TestDataplaneDownloadEndsAtItsSizeWhenOpened: a download sends the file as big as it was when it
// was opened. A process in the sandbox that keeps appending to a file (a log, or a hostile one
// appending as fast as it is read) would otherwise make its download endless: the client's disk
// fills and the connection's slot is held for good. Bytes appended after the open are not sent.
func TestDataplaneDownloadEndsAtItsSizeWhenOpened(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "growing")
	ws := workspaceDir(b, id)
	// Far more than the connection's write queue: the broker has not read the end when the client
	// takes its first chunk, so the append below lands before the broker reaches it.
	const size = 64 << 20
	f, err := os.Create(filepath.Join(ws, "grows.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, url, b.Client.APIKey())
	c.sendJSON(protocol.Request{ID: 1, Op: "download", Args: map[string]any{"path": "grows.log"}})
	for len(c.bins[1]) == 0 {
		if err := c.readOne(10 * time.Second); err != nil {
			t.Fatalf("waiting for the first chunk: %v", err)
		}
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte("appended\n"), 1<<17), size); err != nil {
		t.Fatal(err)
	}
	got := c.await(1)
	if got.Error != nil {
		t.Fatalf("download: %s", got)
	}
	var res protocol.DownloadResult
	if err := json.Unmarshal(got.Result, &res); err != nil {
		t.Fatal(err)
	}
	sent := 0
	for _, bin := range got.bin {
		sent += len(bin) - 1
	}
	if res.Size != size || sent != size {
		t.Fatalf("download sent %d bytes and answered size %d; want the %d the file had when opened", sent, res.Size, size)
	}
}

// A download whose writer fails (a full disk under sbctl cp, a capped buffer) is cancelled at the
// broker: the call returns the writer's error at once and the connection serves the next call,
// where the client kept taking (and discarding) the rest of the file, here a sparse terabyte, until
// its context ran out.
func TestDownloadStopsWhenItsWriterFails(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "huge")
	f, err := os.Create(filepath.Join(workspaceDir(b, id), "huge.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(1 << 40); err != nil {
		t.Fatal(err)
	}
	f.Close()
	r, err := backend.Dial(t.Context(), backend.Config{URL: url, Credential: b.Client.APIKey()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	full := errors.New("no space left on the client's disk")
	_, err = r.Download(ctx, "huge.bin", &failingWriter{left: 8 << 20, err: full})
	if !errors.Is(err, full) {
		t.Fatalf("a download whose writer failed: %v; want the writer's error", err)
	}
	if err := r.Ping(ctx); err != nil {
		t.Fatalf("the connection after the cancelled download: %v", err)
	}
}

// failingWriter takes left bytes, then fails every write with err.
type failingWriter struct {
	left int
	err  error
}

func (w *failingWriter) Write(p []byte) (int, error) {
	if len(p) > w.left {
		return 0, w.err
	}
	w.left -= len(p)
	return len(p), nil
}
