package server_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// A failure in the dataplane reader's own code (here made by a hook before a stat's dispatch)
// closes that connection with 1011 and nothing else, whichever goroutine reads: the upgrade's
// handler, or the one that took over reading while an exec runs (which no HTTP middleware covers:
// a panic there ended the broker). The connection's holdings are given back and the broker serves
// on.
func TestDataplaneReaderPanicClosesOnlyItsConnection(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	server.SetReaderHook(b.Server, func(op string) {
		if op == protocol.OpStat {
			panic("a bug in the reader")
		}
	})
	res, err := b.Client.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: "reader-panic"})
	if err != nil {
		t.Fatal(err)
	}
	url := dataplaneURL(b, res.Sandbox.ID)

	for _, during := range []string{"", "exec"} {
		c := dialRaw(t, url, b.Client.APIKey())
		if during == "exec" {
			// The exec takes the reader until its command runs; a new goroutine reads on.
			c.sendJSON(protocol.Request{ID: 1, Op: protocol.OpExec, Args: map[string]any{"command": "sleep 30"}})
			if a := c.call(2, protocol.OpPing, nil); a.Error != nil {
				t.Fatalf("ping during the exec: %s", a)
			}
		}
		c.sendJSON(protocol.Request{ID: 3, Op: protocol.OpStat, Args: map[string]any{"path": "x"}})
		var err error
		for err == nil {
			err = c.readOne(20 * time.Second)
		}
		if ce := (*websocket.CloseError)(nil); !errors.As(err, &ce) || ce.Code != websocket.CloseInternalServerErr {
			t.Fatalf("reader failing (during %q): the connection ended with %v, want a close 1011", during, err)
		}
	}
	if !wait.Until(20*time.Second, func() bool {
		return dpConnections(t, b) == 0 && server.Usage(b.Server) == (server.DataplaneUsage{})
	}) {
		t.Fatalf("after the readers failed: %d connections open, %+v held", dpConnections(t, b), server.Usage(b.Server))
	}
	c := dialRaw(t, url, b.Client.APIKey())
	if a := c.call(4, protocol.OpPing, nil); a.Error != nil {
		t.Fatalf("a new connection after the failures: %s", a)
	}
}
