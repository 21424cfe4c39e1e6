package mcp_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/mcp"
	"github.com/sbxbroker/broker/protocol"
)

// A client that writes its requests and closes stdin at once (`printf ... | sbctl mcp dev`, a
// script's communicate()) gets every answer: the server ends at the end of its input only once
// the requests read are answered. Messages the SDK would end the session for (an id that is an
// object, no "jsonrpc":"2.0", a batch, a bare number) are refused each on its own, and the
// session goes on.
func TestStdioAnswersRequestsReadBeforeEOF(t *testing.T) {
	in := strings.Join([]string{
		`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"1"}}}`,
		`{"jsonrpc":"2.0","method":"notifications/initialized"}`,
		`{"jsonrpc":"2.0","id":"two","method":"tools/list"}`,
		`{"jsonrpc":"2.0","id":3.0,"method":"ping"}`,
		`{"jsonrpc":"2.0","id":4,"method":"no/such/method"}`,
		`{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"no_such_tool","arguments":{}}}`,
		`{"jsonrpc":"2.0","id":{"bad":1},"method":"ping"}`,
		`{"id":6,"method":"ping"}`,
		`[{"jsonrpc":"2.0","id":7,"method":"ping"}]`,
		`8`,
		`{"jsonrpc":"2.0","id":9,"method":"ping"}`,
	}, "\n") + "\n"
	var out bytes.Buffer
	srv := mcp.NewServer(nil, mcp.Options{Scopes: []string{protocol.ScopeFSRead}})
	if err := srv.Run(t.Context(), mcp.StdioTransport(strings.NewReader(in), &out)); err != nil {
		t.Errorf("run: %v", err)
	}
	got := out.String()
	for _, id := range []string{`"id":1,`, `"id":"two"`, `"id":3,`, `"id":4,`, `"id":5,`, `"id":6,"error"`, `"id":9,"result"`} {
		if !strings.Contains(got, id) {
			t.Errorf("no answer with %s:\n%s", id, got)
		}
	}
	if n := strings.Count(got, `"id":null,"error"`); n != 3 {
		t.Errorf("%d refusals of id null, want 3 (the object id, the batch, the number):\n%s", n, got)
	}
}
