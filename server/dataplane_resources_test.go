package server_test

// Resource accounting of the dataplane: everything a connection holds of the broker's shared slots
// and memory is given back however the connection ends, and what a client does not read is counted
// and bounded.

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
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
	if !waitFor(20*time.Second, func() bool { return server.Usage(b.Server).HeavySlots >= 4 }) {
		t.Fatalf("the unread answers hold %+v, want heavy slots", server.Usage(b.Server))
	}
	for _, c := range crashed {
		for j := uint32(20); j < 28; j++ {
			c.sendJSON(protocol.Request{ID: j, Op: "exec", Args: map[string]any{"command": bigOutput(8 << 20), "max_output": 8 << 20}})
		}
	}
	if !waitFor(30*time.Second, func() bool { return server.Usage(b.Server).ExecOutputBytes >= 32<<20 }) {
		t.Fatalf("the unread execs hold %+v, want their output", server.Usage(b.Server))
	}
	t.Logf("held before the hang-ups: %+v", server.Usage(b.Server))
	for _, c := range crashed {
		c.ws.UnderlyingConn().Close() // a crash: no close frame
	}
	if !waitFor(10*time.Second, func() bool { return dpConnections(t, b) == baseConns }) {
		t.Fatalf("%d connections after the hang-ups, want %d", dpConnections(t, b), baseConns)
	}
	if !waitFor(5*time.Second, func() bool { return server.Usage(b.Server) == (server.DataplaneUsage{}) }) {
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
