package faults

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
)

// crashyConn is a dataplane connection whose client never reads and then dies without a close frame.
type crashyConn struct{ ws *websocket.Conn }

func dialCrashy(t *testing.T, url, cred string) crashyConn {
	t.Helper()
	d := websocket.Dialer{Subprotocols: []string{protocol.Subprotocol}, HandshakeTimeout: 10 * time.Second, ReadBufferSize: 1024}
	ws, _, err := d.Dial(url, http.Header{"Authorization": {"Bearer " + cred}})
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	t.Cleanup(func() { ws.Close() })
	return crashyConn{ws}
}

func (c crashyConn) send(t *testing.T, id uint32, op string, args map[string]any) {
	t.Helper()
	c.ws.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if err := c.ws.WriteJSON(protocol.Request{ID: id, Op: op, Args: args}); err != nil {
		t.Fatalf("send %s: %v", op, err)
	}
}

// Agents that crash (TCP closed without a close frame) while their answers wait unread give back
// everything they held: the broker-wide read/ls/glob/grep slots and the exec output budget go back
// to zero on /metrics, and another org's reads are answered and its exec gets its whole output.
func TestDataplaneHangupsReleaseEverything(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key, otherKey := r.apiKey("acme"), r.apiKey("bystander")
	b := startBroker(t, r, "n1")
	c := b.client(key)
	sb := create(t, c, "crashy", time.Hour)
	ws := filepath.Join(b.DataDir, "sandboxes", sb.ID, "workspace")
	if err := os.WriteFile(filepath.Join(ws, "big.txt"), bytes.Repeat([]byte("0123456789abcdef"), 4<<20/16), 0o644); err != nil {
		t.Fatal(err)
	}
	url := get(t, c, sb.ID).DataplaneURL
	var crashed []crashyConn
	for i := 0; i < 8; i++ {
		cc := dialCrashy(t, url, key)
		for j := uint32(1); j <= 16; j++ {
			cc.send(t, j, "read", map[string]any{"path": "big.txt"})
		}
		cc.send(t, 17, "ls", map[string]any{"path": "."})
		cc.send(t, 18, "grep", map[string]any{"pattern": "needle"})
		for j := uint32(20); j < 24; j++ {
			cc.send(t, j, "exec", map[string]any{"command": "head -c 8388608 /dev/zero | tr '\\0' x", "max_output": 8 << 20})
		}
		crashed = append(crashed, cc)
	}
	eventually(t, 30*time.Second, "the unread answers hold no heavy slot and no exec output", func() bool {
		return b.metric("sbx_dataplane_heavy_slots") >= 4 && b.metric("sbx_dataplane_exec_output_bytes") >= 8<<20
	})
	for _, cc := range crashed {
		cc.ws.UnderlyingConn().Close() // a crash: no close frame
	}
	eventually(t, 15*time.Second, "the crashed connections still hold slots, output or connections", func() bool {
		return b.metric("sbx_dataplane_heavy_slots") == 0 && b.metric("sbx_dataplane_exec_output_bytes") == 0 &&
			b.metric("sbx_dataplane_queued_bytes") == 0 && b.metric("sbx_dataplane_connections") == 0
	})

	oc := b.client(otherKey)
	other := create(t, oc, "bystander", time.Hour)
	agent, err := backend.Dial(context.Background(), backend.Config{URL: get(t, oc, other.ID).DataplaneURL, Credential: otherKey})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := agent.Ls(ctx, "/workspace"); err != nil {
		t.Fatalf("another org's ls after the hang-ups: %v", err)
	}
	res, err := agent.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "head -c 1048576 /dev/zero | tr '\\0' x", MaxOutput: 2 << 20}})
	if err != nil || res.Truncated || res.Stdout == nil || len(*res.Stdout) != 1<<20 {
		n := 0
		if res.Stdout != nil {
			n = len(*res.Stdout)
		}
		t.Fatalf("another org's exec after the hang-ups: %v, truncated %v, %d bytes of 1 MiB", err, res.Truncated, n)
	}
}

// A graceful shutdown (SIGTERM) lets a dataplane command in flight finish within
// --shutdown-timeout: the agent gets its output and exit code, not a cut connection.
func TestGracefulShutdownDrainsInflight(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key := r.apiKey("acme")
	b := startBroker(t, r, "n1", "--shutdown-timeout", "30s")
	c := b.client(key)
	sb := create(t, c, "dev", time.Hour)
	agent := agentOn(t, c, "dev")
	started := filepath.Join(b.DataDir, "sandboxes", sb.ID, "workspace", "started")
	type answer struct {
		res protocol.ExecResult
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := agent.Exec(context.Background(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{
			Command: "touch /workspace/started; sleep 2; echo finished"}})
		done <- answer{res, err}
	}()
	eventually(t, 20*time.Second, "the command did not start", func() bool {
		_, err := os.Stat(started)
		return err == nil
	})
	stopped := make(chan struct{})
	go func() { b.stop(); close(stopped) }()
	select {
	case a := <-done:
		if a.err != nil || a.res.ExitCode != 0 || a.res.Stdout == nil || strings.TrimSpace(*a.res.Stdout) != "finished" {
			t.Fatalf("the command in flight at SIGTERM: %+v %v; want it to finish", a.res, a.err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the command in flight at SIGTERM never answered")
	}
	<-stopped
	if !strings.Contains(b.Log(), "shutting down") {
		t.Fatalf("no graceful shutdown in the log:\n%s", b.Log())
	}
}

// One credential or one org cannot take every dataplane connection: past its cap an upgrade is
// refused with 429 too_many_connections and a Retry-After, and another org still connects.
func TestDataplaneConnectionCaps(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key, otherKey := r.apiKey("acme"), r.apiKey("bystander")
	b := startBroker(t, r, "n1", "--max-dataplane-connections-per-credential", "2", "--max-dataplane-connections-per-org", "3")
	c := b.client(key)
	sb := create(t, c, "dev", time.Hour)
	url := get(t, c, sb.ID).DataplaneURL
	refused := func(cred string) (int, string, string) {
		d := websocket.Dialer{Subprotocols: []string{protocol.Subprotocol}, HandshakeTimeout: 10 * time.Second}
		ws, resp, err := d.Dial(url, http.Header{"Authorization": {"Bearer " + cred}})
		if err == nil {
			t.Cleanup(func() { ws.Close() })
			return 101, "", ""
		}
		if resp == nil {
			t.Fatalf("dial: %v", err)
		}
		var body bytes.Buffer
		body.ReadFrom(resp.Body)
		return resp.StatusCode, resp.Header.Get("Retry-After"), body.String()
	}
	for i := 0; i < 2; i++ {
		if code, _, body := refused(key); code != 101 {
			t.Fatalf("connection %d within the cap: %d %s", i+1, code, body)
		}
	}
	if code, retry, body := refused(key); code != http.StatusTooManyRequests || retry == "" || !strings.Contains(body, "too_many_connections") {
		t.Fatalf("a third connection of one key: %d, Retry-After %q, %s", code, retry, body)
	}
	// The org's third connection, through a delegation token (another credential), is its last.
	mint, err := c.Delegate(context.Background(), sb.ID, protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	if code, _, body := refused(mint.Token); code != 101 {
		t.Fatalf("the org's third connection: %d %s", code, body)
	}
	if code, _, body := refused(mint.Token); code != http.StatusTooManyRequests || !strings.Contains(body, "too_many_connections") {
		t.Fatalf("the org's fourth connection: %d %s", code, body)
	}
	oc := b.client(otherKey)
	other := create(t, oc, "other", time.Hour)
	url = get(t, oc, other.ID).DataplaneURL
	if code, _, body := refused(otherKey); code != 101 {
		t.Fatalf("another org's connection: %d %s", code, body)
	}
}
