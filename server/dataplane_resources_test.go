package server_test

// Resource accounting of the dataplane: everything a connection holds of the broker's shared slots
// and memory is given back however the connection ends, and what a client does not read is counted
// and bounded.

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

// bigOutput is a shell command that prints n bytes of 'x' (no newline).
func bigOutput(n int) string { return "head -c " + strconv.Itoa(n) + " /dev/zero | tr '\\0' x" }

// Eight agents that crash (the TCP connection closes without a close frame) while answers to their
// reads, listings, searches and execs wait unread leave nothing behind: the broker-wide slots and
// the exec output budget are all given back, so another org's reads are answered and its execs get
// their whole output. Before, every slot leaked for good with the answers queued at the hang-up:
// other orgs' read/ls/glob/grep waited until a restart, and non-streamed execs answered empty with
// truncated: true.
func TestDataplaneHangupsReleaseEverything(t *testing.T) {
	// Not parallel: it fills the broker-wide slots and budget on purpose.
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	id, url := newSandbox(t, b, "crashy")
	ws := workspaceDir(b, id)
	big := bytes.Repeat([]byte("0123456789abcdef"), 4<<20/16)
	if err := os.WriteFile(filepath.Join(ws, "big.txt"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		os.WriteFile(filepath.Join(ws, "f"+strconv.Itoa(i)+".txt"), []byte("needle\n"), 0o644)
	}
	key := b.Client.APIKey()
	baseConns := dpConnections(t, b)

	var crashed []*rawConn
	for i := 0; i < 8; i++ {
		c := dialRaw(t, url, key)
		for j := uint32(1); j <= 16; j++ {
			c.sendJSON(protocol.Request{ID: j, Op: "read", Args: map[string]any{"path": "big.txt"}})
		}
		c.sendJSON(protocol.Request{ID: 17, Op: "ls", Args: map[string]any{"path": "."}})
		c.sendJSON(protocol.Request{ID: 18, Op: "glob", Args: map[string]any{"pattern": "*.txt"}})
		c.sendJSON(protocol.Request{ID: 19, Op: "grep", Args: map[string]any{"pattern": "needle"}})
		crashed = append(crashed, c)
	}
	// Every connection's writer is stuck on a 4 MiB answer its client does not read, and the
	// answers behind it hold broker-wide slots (before fair shares: all sixteen).
	if !wait.Until(20*time.Second, func() bool { return server.Usage(b.Server).HeavySlots >= 4 }) {
		t.Fatalf("the unread answers hold %+v, want heavy slots", server.Usage(b.Server))
	}
	for _, c := range crashed {
		for j := uint32(20); j < 28; j++ {
			c.sendJSON(protocol.Request{ID: j, Op: "exec", Args: map[string]any{"command": bigOutput(8 << 20), "max_output": 8 << 20}})
		}
	}
	if !wait.Until(30*time.Second, func() bool { return server.Usage(b.Server).ExecOutputBytes >= 32<<20 }) {
		t.Fatalf("the unread execs hold %+v, want their output", server.Usage(b.Server))
	}
	t.Logf("held before the hang-ups: %+v", server.Usage(b.Server))
	for _, c := range crashed {
		c.ws.UnderlyingConn().Close() // a crash: no close frame
	}
	if !wait.Until(10*time.Second, func() bool { return dpConnections(t, b) == baseConns }) {
		t.Fatalf("%d connections after the hang-ups, want %d", dpConnections(t, b), baseConns)
	}
	if !wait.Until(5*time.Second, func() bool { return server.Usage(b.Server) == (server.DataplaneUsage{}) }) {
		t.Errorf("after the hang-ups the broker still holds %+v, want nothing", server.Usage(b.Server))
	}

	// Another org is served in full.
	other := b.NewClient("other-org")
	res, err := other.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: "bystander"})
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(workspaceDir(b, res.Sandbox.ID), "small.txt"), []byte("hi\n"), 0o644)
	c := dialRaw(t, dataplaneURL(b, res.Sandbox.ID), other.APIKey())
	for i, op := range []string{"read", "ls", "glob", "grep"} {
		args := map[string]any{"path": "small.txt"}
		switch op {
		case "ls":
			args = map[string]any{"path": "."}
		case "glob":
			args = map[string]any{"pattern": "*.txt"}
		case "grep":
			args = map[string]any{"pattern": "hi"}
		}
		c.sendJSON(protocol.Request{ID: uint32(i + 1), Op: op, Args: args})
		if err := c.readOne(5 * time.Second); err != nil {
			t.Fatalf("%s after the hang-ups: no answer: %v", op, err)
		}
		if got := c.await(uint32(i + 1)); got.Error != nil {
			t.Fatalf("%s after the hang-ups: %s", op, got)
		}
	}
	got := c.call(10, "exec", map[string]any{"command": bigOutput(1 << 20), "max_output": 2 << 20})
	var er protocol.ExecResult
	if got.Error != nil || got.decode(&er) != nil {
		t.Fatalf("exec after the hang-ups: %s", got)
	}
	if er.Truncated || er.Stdout == nil || len(*er.Stdout) != 1<<20 {
		t.Fatalf("exec after the hang-ups: truncated %v, %d bytes of output, want 1 MiB", er.Truncated, len(deref(er.Stdout)))
	}
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// Non-streamed exec output that clients do not read stays inside the broker-wide budget, counted
// from the first byte until the answer is written: its buffers while the command runs, then the
// encoded answer. Before, only the bytes written into the buffers were counted and the budget was
// given back when the writer took the answer: six connections with 64 unread 8 MiB execs each held
// 1.5 to 1.8 GiB against a 256 MiB budget (buffers grown by doubling, a string copy and the
// encoded answer each, for every answer waiting to be queued).
func TestDataplaneUnreadExecsStayInBudget(t *testing.T) {
	// Not parallel: it measures this process's heap and fills the broker-wide budget.
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	const conns, execs, size = 6, 64, 8 << 20
	base := heapInuse()
	var clients []*rawConn
	var peak server.DataplaneUsage
	var peakHeap uint64
	sample := func() {
		u := server.Usage(b.Server)
		peak.ExecOutputBytes = max(peak.ExecOutputBytes, u.ExecOutputBytes)
		peak.QueuedBytes = max(peak.QueuedBytes, u.QueuedBytes)
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		peakHeap = max(peakHeap, m.HeapInuse)
	}
	for i := 0; i < conns; i++ {
		// One org each, so that the broker-wide budget, not an org's share, is what binds.
		cl := b.NewClient("execorg" + strconv.Itoa(i))
		res, err := cl.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: "x"})
		if err != nil {
			t.Fatal(err)
		}
		c := dialRaw(t, dataplaneURL(b, res.Sandbox.ID), cl.APIKey())
		for j := uint32(1); j <= execs; j++ {
			c.sendJSON(protocol.Request{ID: j, Op: "exec", Args: map[string]any{"command": bigOutput(size), "max_output": size}})
		}
		clients = append(clients, c)
	}
	// Until every command has run (each exec event is emitted when its command ends).
	var events int
	wait.Until(60*time.Second, func() bool {
		sample()
		events = 0
		for i := 0; i < conns; i++ {
			events += execEvents(t, b, "execorg"+strconv.Itoa(i))
		}
		return events >= conns*execs
	})
	sample()
	held := heapInuse() // live: what the broker holds for the clients once everything ran
	t.Logf("%d connections x %d unread %d MiB execs (%d ran): peak exec output %d MiB, peak queued %d MiB; heap %d MiB before, %d MiB live after (peak with garbage %d MiB)",
		conns, execs, size>>20, events, peak.ExecOutputBytes>>20, peak.QueuedBytes>>20, base>>20, held>>20, peakHeap>>20)
	if events < conns*execs {
		t.Fatalf("only %d of %d execs ran", events, conns*execs)
	}
	// Encoding adds a few bytes per answer to output that was within the budget.
	if peak.ExecOutputBytes > 256<<20+conns*execs*1024 {
		t.Errorf("exec output held peaked at %d MiB, over the 256 MiB budget", peak.ExecOutputBytes>>20)
	}
	// The live heap is the budget and little else (the queues' answers are in the budget too).
	if grew := int64(held) - int64(base); grew > 256<<20+128<<20 {
		t.Errorf("the broker holds %d MiB for the clients, over the 256 MiB budget", grew>>20)
	}
	for _, c := range clients {
		c.ws.Close()
	}
	if !wait.Until(10*time.Second, func() bool { return server.Usage(b.Server) == (server.DataplaneUsage{}) }) {
		t.Errorf("after the clients left the broker still holds %+v", server.Usage(b.Server))
	}
}

// execEvents counts the exec events in org's event stream: one per command that ended.
func execEvents(t testing.TB, b *servertest.Broker, org string) int {
	t.Helper()
	msgs, err := b.RDB.XRange(context.Background(), store.EventsKey(org), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range msgs {
		if data, _ := m.Values["data"].(string); strings.Contains(data, `"type":"exec"`) {
			n++
		}
	}
	return n
}

// Downloads that their clients do not read hold what their connection's queue allows, every chunk
// counted from before it is read from the file. Before, each connection held about 11 MiB: eight
// queued chunks, the one being written and the ones being read, none of them counted.
func TestDataplaneUnreadDownloadsAreCounted(t *testing.T) {
	// Not parallel: it measures this process's heap.
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	id, url := newSandbox(t, b, "dl")
	f, err := os.Create(filepath.Join(workspaceDir(b, id), "huge.bin"))
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(256 << 20) // sparse: far more than any buffer on the way
	f.Close()
	key := b.Client.APIKey()
	const conns = 8
	base := heapInuse()
	var clients []*rawConn
	for i := 0; i < conns; i++ {
		c := dialRaw(t, url, key)
		c.sendJSON(protocol.Request{ID: 1, Op: "download", Args: map[string]any{"path": "huge.bin"}})
		c.sendJSON(protocol.Request{ID: 2, Op: "download", Args: map[string]any{"path": "huge.bin"}})
		clients = append(clients, c)
	}
	// The queues fill, then nothing moves: a full queue is three 1 MiB chunks (a fourth would
	// pass its 4 MiB), so once every connection holds three, no download reads further.
	const chunk = protocol.FrameHeaderLen + 1<<20
	if !wait.Until(20*time.Second, func() bool { return server.Usage(b.Server).QueuedBytes >= conns*3*chunk }) {
		t.Fatalf("%d bytes queued for %d connections, want their queues full (three chunks each)", server.Usage(b.Server).QueuedBytes, conns)
	}
	held := heapInuse()
	perConn := (int64(held) - int64(base)) / conns
	t.Logf("%d connections with 2 unread downloads each: %d MiB queued in all, %.1f MiB of heap per connection",
		conns, server.Usage(b.Server).QueuedBytes>>20, float64(perConn)/(1<<20))
	if q := server.Usage(b.Server).QueuedBytes; q == 0 || q > conns*4<<20 {
		t.Errorf("%d bytes queued for %d connections, want some and at most 4 MiB each", q, conns)
	}
	// The queue, and the test client's own 2 MiB write buffer (it is in this process too).
	if perConn > 8<<20 {
		t.Errorf("each connection holds %.1f MiB of heap, want at most its 4 MiB queue and the test client's buffer", float64(perConn)/(1<<20))
	}
	for _, c := range clients {
		c.ws.Close()
	}
	if !wait.Until(10*time.Second, func() bool { return server.Usage(b.Server) == (server.DataplaneUsage{}) }) {
		t.Errorf("after the clients left the broker still holds %+v", server.Usage(b.Server))
	}
}

// One org whose clients never read their answers holds at most its share of the broker-wide slots
// of read, ls, glob and grep, so another org's are still answered. Before, eight such connections
// held all sixteen and every other org's reads waited until they read.
func TestDataplaneHeavySlotsSharedFairly(t *testing.T) {
	// Not parallel: it fills the broker-wide slots on purpose.
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	id, url := newSandbox(t, b, "hog")
	big := bytes.Repeat([]byte("0123456789abcdef"), 4<<20/16)
	if err := os.WriteFile(filepath.Join(workspaceDir(b, id), "big.txt"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	key := b.Client.APIKey()
	for i := 0; i < 8; i++ {
		c := dialRaw(t, url, key)
		for j := uint32(1); j <= 16; j++ {
			c.sendJSON(protocol.Request{ID: j, Op: "read", Args: map[string]any{"path": "big.txt"}})
		}
	}
	// The hog's connections take every slot they can get (its share: four) and keep them. With
	// 128 reads waiting, a slot it could take is taken within milliseconds: a second of watching
	// shows one over its share.
	wait.Eventually(t, 10*time.Second, func() bool { return server.OrgUsage(b.Server, b.Org).HeavySlots >= 4 },
		"the org that does not read holding its four heavy slots")
	wait.Never(t, time.Second, func() bool { return server.OrgUsage(b.Server, b.Org).HeavySlots > 4 },
		"the org that does not read holds more than its four heavy slots")
	t.Logf("an org that does not read holds %d of the broker's heavy slots", server.OrgUsage(b.Server, b.Org).HeavySlots)

	other := b.NewClient("fair-org")
	res, err := other.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: "reader"})
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(workspaceDir(b, res.Sandbox.ID), "small.txt"), []byte("hi\n"), 0o644)
	c := dialRaw(t, dataplaneURL(b, res.Sandbox.ID), other.APIKey())
	for i := uint32(1); i <= 4; i++ { // as many at once as the other org may hold
		c.sendJSON(protocol.Request{ID: i, Op: "read", Args: map[string]any{"path": "small.txt"}})
	}
	for i := uint32(1); i <= 4; i++ {
		if err := c.readOne(5 * time.Second); err != nil {
			t.Fatalf("another org's read behind an org that does not read: %v", err)
		}
	}
	for i := uint32(1); i <= 4; i++ {
		if got := c.await(i); got.Error != nil {
			t.Fatalf("read %d: %s", i, got)
		}
	}
}

// A read alone on its connection runs on the connection's reader (dpConn.onReader) only when it
// need not wait for a heavy slot: one that must wait does so on its own goroutine, and the reader
// goes on serving the connection (a ping, the read's own cancel).
func TestDataplaneLoneReadWaitingForASlotLeavesTheReaderFree(t *testing.T) {
	// Not parallel: it fills the org's broker-wide slots on purpose.
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	id, url := newSandbox(t, b, "lone")
	big := bytes.Repeat([]byte("0123456789abcdef"), 4<<20/16)
	if err := os.WriteFile(filepath.Join(workspaceDir(b, id), "big.txt"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	key := b.Client.APIKey()
	for i := 0; i < 2; i++ { // two connections that do not read hold the org's four slots
		c := dialRaw(t, url, key)
		for j := uint32(1); j <= 4; j++ {
			c.sendJSON(protocol.Request{ID: j, Op: "read", Args: map[string]any{"path": "big.txt"}})
		}
	}
	wait.Eventually(t, 10*time.Second, func() bool { return server.OrgUsage(b.Server, b.Org).HeavySlots >= 4 },
		"the connections that do not read holding the org's four heavy slots")

	c := dialRaw(t, url, key)
	c.sendJSON(protocol.Request{ID: 1, Op: "read", Args: map[string]any{"path": "big.txt"}})
	c.ping() // within 20 s: the reader is not waiting with the read
	c.sendJSON(protocol.Request{ID: 1, Op: "cancel"})
	if got := c.await(1); got.code() != "cancelled" {
		t.Fatalf("the read waiting for a slot, cancelled: %s", got)
	}
}

// dialRefusal tries an upgrade with cred and returns the refusal's status, Retry-After and body
// (101 when it was accepted; that connection is closed when t ends).
func dialRefusal(t testing.TB, url, cred string) (int, string, protocol.ErrorBody) {
	t.Helper()
	d := websocket.Dialer{Subprotocols: []string{protocol.Subprotocol}, HandshakeTimeout: 10 * time.Second}
	ws, resp, err := d.Dial(url, authHeader(cred))
	if err == nil {
		t.Cleanup(func() { ws.Close() })
		return 101, "", protocol.ErrorBody{}
	}
	if resp == nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	var eb protocol.ErrorBody
	json.NewDecoder(resp.Body).Decode(&eb)
	return resp.StatusCode, resp.Header.Get("Retry-After"), eb
}

// One credential, or one org, cannot take every dataplane connection: past its cap an upgrade is
// refused with 429, a Retry-After and a stable code, and the other orgs still connect. Before, one
// token opened all 4096 and every other org got 503.
func TestDataplaneConnectionCaps(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Dataplane: server.DataplaneLimits{MaxConnections: 20, PerOrg: 6, PerCredential: 4}})
	_, url := newSandbox(t, b, "capped")
	key := b.Client.APIKey()
	tok, err := b.Client.Delegate(context.Background(), "capped", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
	if err != nil {
		t.Fatal(err)
	}
	refused := func(cred, code string) {
		t.Helper()
		status, retry, eb := dialRefusal(t, url, cred)
		if status != 429 || eb.Error.Code != code || retry == "" || !strings.Contains(eb.Error.Message, "retry") {
			t.Fatalf("over the cap: %d Retry-After %q %+v, want 429 %s with Retry-After and a message", status, retry, eb.Error, code)
		}
	}
	var conns []*rawConn
	for i := 0; i < 4; i++ {
		conns = append(conns, dialRaw(t, url, key))
	}
	refused(key, protocol.CodeTooManyConnections) // the key's cap
	for i := 0; i < 2; i++ {
		dialRaw(t, url, tok.Token)
	}
	refused(tok.Token, protocol.CodeTooManyConnections) // the org's cap, with the token under its own

	// Another org is not affected.
	other := b.NewClient("uncapped-org")
	res, err := other.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: "free"})
	if err != nil {
		t.Fatal(err)
	}
	dialRaw(t, dataplaneURL(b, res.Sandbox.ID), other.APIKey()).ping()

	// A connection that ends gives its place back.
	conns[0].ws.Close()
	if !wait.Until(5*time.Second, func() bool { s, _, _ := dialRefusal(t, url, key); return s == 101 }) {
		t.Fatal("the key could not connect again after one of its connections closed")
	}
}

// A graceful shutdown lets the dataplane requests in flight finish (up to the shutdown timeout),
// refuses new ones with unavailable, then closes with 1001. Before, it cancelled them at once: an
// agent's command that was about to finish was killed by every broker restart.
func TestDataplaneShutdownDrainsInflight(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	_, url := newSandbox(t, b, "drain")
	c := dialRaw(t, url, b.Client.APIKey())
	c.sendJSON(protocol.Request{ID: 1, Op: "exec", Args: map[string]any{"command": "sleep 1.5; echo done"}})
	c.ping() // the exec is in flight
	stopped := make(chan time.Duration, 1)
	start := time.Now()
	go func() { b.StopWithin(20 * time.Second); stopped <- time.Since(start) }()

	// Requests sent once the shutdown began are refused, not started.
	var refused answer
	for id := uint32(100); ; id++ {
		got := c.call(id, "stat", map[string]any{"path": "."})
		if got.Error != nil {
			refused = got
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatal("the shutdown never refused a new request")
		}
	}
	if refused.code() != protocol.CodeUnavailable || !strings.Contains(refused.Error.Message, "shutting down") {
		t.Errorf("a request during the shutdown: %s, want unavailable", refused)
	}
	// The request in flight is answered in full.
	got := c.await(1)
	var er protocol.ExecResult
	if got.Error != nil || got.decode(&er) != nil || er.ExitCode != 0 || deref(er.Stdout) != "done\n" {
		t.Fatalf("the exec in flight during the shutdown: %s", got)
	}
	select {
	case got := <-closeWatch(c):
		if got.code != websocket.CloseGoingAway {
			t.Errorf("closed by %d %q (%v), want 1001", got.code, got.reason, got.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the connection stayed open after its requests were answered")
	}
	if took := <-stopped; took > 10*time.Second {
		t.Errorf("the shutdown took %s with nothing left in flight after 1.5 s", took)
	}
}

// The bytes waiting for clients that do not read are bounded broker-wide, not only per connection,
// and one org holds at most its share of them (256 MiB): another org's transfers still run. Before,
// an org's queues were bounded only by its connection count (1024 connections x 4 MiB).
func TestDataplaneUnreadQueuesShareFairly(t *testing.T) {
	// Not parallel: it fills an org's share of the broker's queue memory.
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "hoard")
	f, err := os.Create(filepath.Join(workspaceDir(b, id), "huge.bin"))
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(256 << 20) // sparse: far more than any buffer on the way
	f.Close()
	key := b.Client.APIKey()
	const conns = 100 // 100 queues of three 1 MiB chunks: more than the org's 256 MiB share
	for i := 0; i < conns; i++ {
		c := dialRaw(t, url, key)
		c.sendJSON(protocol.Request{ID: 1, Op: "download", Args: map[string]any{"path": "huge.bin"}})
	}
	// The org's queues fill up to its share (less than a chunk short of it); from then on, with
	// a hundred downloads waiting for room, a chunk past the share would be queued within
	// milliseconds: a second of watching shows it.
	const chunk = protocol.FrameHeaderLen + 1<<20
	wait.Eventually(t, 20*time.Second, func() bool { return server.OrgUsage(b.Server, b.Org).QueuedBytes > 256<<20-chunk },
		"one org's unread queues filled to its 256 MiB share")
	wait.Never(t, time.Second, func() bool { return server.OrgUsage(b.Server, b.Org).QueuedBytes > 256<<20 },
		"one org's unread queues hold over its 256 MiB share")
	held := server.OrgUsage(b.Server, b.Org).QueuedBytes
	t.Logf("%d connections of one org with an unread download each: %d MiB queued for the org", conns, held>>20)
	if held > 256<<20 {
		t.Errorf("one org's unread queues hold %d MiB, over its 256 MiB share", held>>20)
	}

	// Another org's download runs to the end meanwhile.
	other := b.NewClient("moving-org")
	res, err := other.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: "mover"})
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(workspaceDir(b, res.Sandbox.ID), "f.bin"), bytes.Repeat([]byte("z"), 3<<20), 0o644)
	c := dialRaw(t, dataplaneURL(b, res.Sandbox.ID), other.APIKey())
	got := c.call(1, "download", map[string]any{"path": "f.bin"})
	var dr protocol.DownloadResult
	if got.Error != nil || got.decode(&dr) != nil || dr.Size != 3<<20 {
		t.Fatalf("another org's download: %s", got)
	}
}

// The accounting is on /metrics, so an operator sees what clients that do not read hold.
func TestDataplaneAccountingMetrics(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "metered")
	f, err := os.Create(filepath.Join(workspaceDir(b, id), "huge.bin"))
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(64 << 20)
	f.Close()
	c := dialRaw(t, url, b.Client.APIKey())
	c.sendJSON(protocol.Request{ID: 1, Op: "download", Args: map[string]any{"path": "huge.bin"}})
	metric := func(name string) float64 {
		resp, err := http.Get(b.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		for _, line := range strings.Split(string(raw), "\n") {
			if v, ok := strings.CutPrefix(line, name+" "); ok {
				n, _ := strconv.ParseFloat(v, 64)
				return n
			}
		}
		t.Fatalf("no %s metric", name)
		return 0
	}
	if !wait.Until(10*time.Second, func() bool { return metric("sbx_dataplane_queued_bytes") > 0 }) {
		t.Fatal("an unread download shows no queued bytes")
	}
	for _, name := range []string{"sbx_dataplane_heavy_slots", "sbx_dataplane_exec_output_bytes"} {
		if v := metric(name); v != 0 {
			t.Errorf("%s = %v with nothing holding it", name, v)
		}
	}
	c.ws.Close()
	if !wait.Until(10*time.Second, func() bool { return metric("sbx_dataplane_queued_bytes") == 0 }) {
		t.Error("the queued bytes stay after the client left")
	}
}

// A one-file op whose path is deep does not run on the connection's reader: creating missing
// parents makes a directory per level (a thousand here, tenths of a second), and on the
// reader it would hold up everything else the connection sends meanwhile (a ping here, a cancel).
// The ping is answered first.
func TestDataplaneDeepPathLeavesTheReaderFree(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "deep")
	deep := strings.TrimSuffix(strings.Repeat("d/", 1000), "/")
	for _, tc := range []struct {
		op   string
		args any
	}{
		{"mkdir", protocol.MkdirArgs{Path: "m/" + deep, Parents: true}},
		{"write", map[string]any{"path": "w/" + deep + "/f", "content": "x"}},
		{"move", protocol.MoveArgs{From: "src", To: "v/" + deep + "/f"}},
	} {
		c := dialRaw(t, url, b.Client.APIKey())
		if tc.op == "move" {
			if got := c.call(2, "write", map[string]any{"path": "src", "content": "x"}); got.Error != nil {
				t.Fatalf("write src: %s", got)
			}
		}
		c.sendJSON(protocol.Request{ID: 1, Op: tc.op, Args: tc.args})
		c.sendJSON(protocol.Request{ID: pingID, Op: "ping"})
		for len(c.answers[pingID]) == 0 {
			if err := c.readOne(60 * time.Second); err != nil {
				t.Fatalf("%s: waiting for the ping's answer: %v", tc.op, err)
			}
		}
		if len(c.answers[1]) > 0 {
			t.Errorf("%s of a path %d levels deep was answered before a ping sent after it: it held the reader", tc.op, 1001)
		}
		if got := c.await(1); got.Error != nil {
			t.Fatalf("%s: %s", tc.op, got)
		}
	}
}
