package server_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// One source address cannot hold more than its share of the broker's connections: with no
// credentials at all, a GET /healthz per connection kept alive (or connections that never send a
// byte) would otherwise take every descriptor the broker has. Past the cap a new connection is
// answered 429 too_many_connections and closed; other sources are served meanwhile; a connection
// that ends frees its place.
func TestConnectionsPerSourceAreBounded(t *testing.T) {
	t.Parallel()
	const perSource = 4
	b := servertest.New(t, servertest.Options{Provider: "dir", ConnsPerSource: perSource})
	addr := strings.TrimPrefix(b.URL, "http://")

	dialFrom := func(src string) net.Conn {
		t.Helper()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// get sends GET /healthz on c and reads the answer, leaving c open when the broker does.
	get := func(c net.Conn, r *bufio.Reader) (*http.Response, []byte, error) {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: broker\r\n\r\n"); err != nil {
			return nil, nil, err
		}
		resp, err := http.ReadResponse(r, nil)
		if err != nil {
			return nil, nil, err
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, body, err
	}

	held := make([]net.Conn, perSource)
	for i := range held {
		held[i] = dialFrom("127.0.0.1")
		if resp, _, err := get(held[i], bufio.NewReader(held[i])); err != nil || resp.StatusCode != 200 {
			t.Fatalf("connection %d of %d: %v %v", i+1, perSource, resp, err)
		}
	}

	// One more from the same source: refused with a clear answer, then closed.
	c := dialFrom("127.0.0.1")
	r := bufio.NewReader(c)
	c.SetDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatalf("a connection past the cap got no answer: %v", err)
	}
	var eb protocol.ErrorBody
	if err := json.NewDecoder(resp.Body).Decode(&eb); err != nil {
		t.Fatalf("the refusal's body: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != 429 || eb.Error.Code != protocol.CodeTooManyConnections || resp.Header.Get("Retry-After") == "" ||
		!strings.Contains(eb.Error.Message, fmt.Sprint(perSource)) {
		t.Fatalf("past the cap: %d %+v (Retry-After %q); want 429 too_many_connections naming the cap", resp.StatusCode, eb.Error, resp.Header.Get("Retry-After"))
	}
	t0 := time.Now()
	_, err = r.ReadByte()
	t.Logf("after %v: %v", time.Since(t0), err)
	if !errors.Is(err, io.EOF) {
		t.Fatalf("after the refusal: %v, want the connection closed", err)
	}

	// Another source is served meanwhile.
	other := dialFrom("127.0.0.2")
	if resp, _, err := get(other, bufio.NewReader(other)); err != nil || resp.StatusCode != 200 {
		t.Fatalf("another source while the first is at its cap: %v %v", resp, err)
	}

	// A connection that ends frees its place.
	held[0].Close()
	if err := wait.For(10*time.Second, func() error {
		c := dialFrom("127.0.0.1")
		defer c.Close()
		resp, _, err := get(c, bufio.NewReader(c))
		if err != nil {
			return err
		}
		if resp.StatusCode != 200 {
			return fmt.Errorf("still %d", resp.StatusCode)
		}
		return nil
	}); err != nil {
		t.Fatalf("a closed connection's place was not freed: %v", err)
	}
}

// The per-source wrapper keeps net/http's closing handshake: an answer given before a large body
// was read is followed at once by the broker's FIN (net/http's CloseWrite, which it finds by a
// type assertion on the connection), and only after net/http's grace (500 ms) by the close, so a
// client still sending learns the answer is whole before its writes meet a reset. Hidden behind
// the wrapper, the FIN never came: the client read nothing more until the reset, ECONNRESET
// instead of the end of the answer.
func TestSourceConnKeepsHalfClose(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	c, err := net.Dial("tcp", strings.TrimPrefix(b.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	// More body than net/http reads after the handler (256 KiB), of far more declared: it gives up
	// on the body and closes the connection after the answer.
	head := "POST /v1/nothing-here HTTP/1.1\r\nHost: x\r\nContent-Length: " + fmt.Sprint(1<<30) + "\r\n\r\n"
	if _, err := io.WriteString(c, head); err != nil {
		t.Fatal(err)
	}
	go c.Write(make([]byte, 512<<10)) // may block once buffers fill; ends with c
	r := bufio.NewReader(c)
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode < 400 {
		t.Fatalf("POST to no route: %d, want an error answer", resp.StatusCode)
	}
	if _, err := r.ReadByte(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the answer: %v, want the broker's FIN (io.EOF) before any reset", err)
	}
}

// A Go http.Client past the cap gets the 429 as an answer. Written at accept, before the client
// had sent its request, the refusal met a transport that had no request on that connection yet:
// it reported "Unsolicited response received on idle HTTP channel" and a closed connection
// instead, so a client could not tell the cap from a broken broker. The refusal now waits for the
// request's head (briefly, and only for a bounded number of refused connections at once).
func TestGoClientPastTheSourceCapSeesThe429(t *testing.T) {
	t.Parallel()
	const perSource = 2
	b := servertest.New(t, servertest.Options{Provider: "dir", ConnsPerSource: perSource})
	addr := strings.TrimPrefix(b.URL, "http://")
	for i := 0; i < perSource; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: broker\r\n\r\n")
		if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil || resp.StatusCode != 200 {
			t.Fatalf("connection %d of %d: %v %v", i+1, perSource, resp, err)
		}
	}
	for i := 0; i < 300; i++ {
		// A new transport each time: a new connection, as a client's first request makes.
		hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
		resp, err := hc.Get(b.URL + "/healthz")
		if err != nil {
			t.Fatalf("request %d past the cap: %v; want the 429 answer", i+1, err)
		}
		var eb protocol.ErrorBody
		json.NewDecoder(resp.Body).Decode(&eb)
		resp.Body.Close()
		if resp.StatusCode != 429 || eb.Error.Code != protocol.CodeTooManyConnections {
			t.Fatalf("request %d past the cap: %d %+v; want 429 too_many_connections", i+1, resp.StatusCode, eb.Error)
		}
	}
}
