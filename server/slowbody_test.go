package server_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

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
