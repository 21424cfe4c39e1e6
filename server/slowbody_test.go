package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
)

// slowBody sends a request whose headers promise a body that never comes in full, and returns the
// connection with its response's reader.
func slowBody(t *testing.T, b *servertest.Broker, head string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(b.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, head+"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	return c, bufio.NewReader(c)
}

// A request body that stops arriving holds nothing for long: a client that promises a body and
// sends a byte of it, refused for its credentials, used to keep its connection and the server's
// goroutine for as long as it liked (the server reads what is left of an unread body before it
// reuses the connection, with no deadline): a source with no credentials at all could hold the
// broker's descriptors that way. Now a body must arrive within the body wait (here 1 s).
func TestSlowBodyHoldsNothing(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	server.SetBodyWait(b.Server, time.Second)

	c, r := slowBody(t, b, "POST /v1/sandboxes HTTP/1.1\r\nHost: broker\r\n")
	c.SetReadDeadline(time.Now().Add(15 * time.Second))
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Fatalf("no credentials: %d, want 401", resp.StatusCode)
	}
	if _, err := r.ReadByte(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the refusal, the connection of a body that stopped arriving: %v, want closed by the broker", err)
	}

	// An owner's request whose body stops arriving is answered, and its connection closed.
	c, r = slowBody(t, b, "POST /v1/sandboxes HTTP/1.1\r\nHost: broker\r\nAuthorization: Bearer "+b.Client.APIKey()+"\r\n")
	c.SetReadDeadline(time.Now().Add(15 * time.Second))
	resp, err = http.ReadResponse(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	var eb protocol.ErrorBody
	json.NewDecoder(resp.Body).Decode(&eb)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(eb.Error.Message, "did not arrive") {
		t.Fatalf("a body that stopped arriving: %d %+v, want 400 saying it did not arrive", resp.StatusCode, eb)
	}
	if _, err := r.ReadByte(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the answer, the connection of a body that stopped arriving: %v, want closed by the broker", err)
	}
}

// singleConn sends every request on one keep-alive connection, with a bearer token, and counts
// the connections it opened.
type singleConn struct {
	rt     *http.Transport
	token  string
	opened atomic.Int32
}

func (s *singleConn) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(httptrace.WithClientTrace(r.Context(), &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) {
		if !i.Reused {
			s.opened.Add(1)
		}
	}}))
	r.Header.Set("Authorization", "Bearer "+s.token)
	return s.rt.RoundTrip(r)
}

// The body wait bounds a body's arrival, never what the handler does once it has the body: an MCP
// tool call that runs longer than the wait (its answer streamed as SSE) is answered, and the next
// calls on the same keep-alive connection, whose bodies come after the first one's wait has passed,
// are read, not cut by a deadline left on the connection.
func TestBodyWaitSparesLongHandlers(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	server.SetBodyWait(b.Server, time.Second)
	id, _ := newSandbox(t, b, "long-call")
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	m, err := b.Client.Delegate(ctx, id, protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead, protocol.ScopeExec}})
	if err != nil {
		t.Fatal(err)
	}
	tr := &singleConn{rt: &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1}, token: m.Token}
	defer tr.rt.CloseIdleConnections()
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "0"}, nil).Connect(ctx,
		&sdk.StreamableClientTransport{Endpoint: m.Sandbox.MCPURL, HTTPClient: &http.Client{Transport: tr}, DisableStandaloneSSE: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	execute := func(command string) string {
		t.Helper()
		out, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: "execute", Arguments: map[string]any{"command": command}})
		if err != nil {
			t.Fatalf("%s: %v", command, err)
		}
		var text strings.Builder
		for _, c := range out.Content {
			if tc, ok := c.(*sdk.TextContent); ok {
				text.WriteString(tc.Text)
			}
		}
		if out.IsError {
			t.Fatalf("%s: tool error %s", command, text.String())
		}
		return text.String()
	}
	// Twice the body wait: the command's own duration, not a wait of the test's.
	if out := execute("sleep 2; echo slept"); !strings.Contains(out, "slept") {
		t.Fatalf("a call longer than the body wait: %q, want its output", out)
	}
	for i := range 3 {
		if out := execute("echo again"); !strings.Contains(out, "again") {
			t.Fatalf("call %d after the long one: %q", i, out)
		}
	}
	if n := tr.opened.Load(); n != 1 {
		t.Errorf("%d connections opened, want the one kept alive throughout", n)
	}
}

// Every route with a body is bound by the body wait: an MCP request and a batch of heartbeats whose
// bodies stop arriving are answered 400, and their connections closed.
func TestSlowBodyBoundOnEveryRoute(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	server.SetBodyWait(b.Server, time.Second)
	id, _ := newSandbox(t, b, "slow-routes")
	m, err := b.Client.Delegate(t.Context(), id, protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
	if err != nil {
		t.Fatal(err)
	}
	mcpPath := strings.TrimPrefix(m.Sandbox.MCPURL, b.URL)
	for _, head := range []string{
		"POST " + mcpPath + " HTTP/1.1\r\nHost: broker\r\nAccept: application/json, text/event-stream\r\nAuthorization: Bearer " + m.Token + "\r\n",
		"POST /v1/heartbeats HTTP/1.1\r\nHost: broker\r\nAuthorization: Bearer " + b.Client.APIKey() + "\r\n",
	} {
		c, r := slowBody(t, b, head)
		c.SetReadDeadline(time.Now().Add(15 * time.Second))
		resp, err := http.ReadResponse(r, nil)
		if err != nil {
			t.Fatalf("%s: %v", head[:30], err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 {
			t.Errorf("%s: a body that stopped arriving: %d, want 400", head[:30], resp.StatusCode)
		}
		if _, err := r.ReadByte(); !errors.Is(err, io.EOF) {
			t.Errorf("%s: after the answer: %v, want the connection closed by the broker", head[:30], err)
		}
	}
}
