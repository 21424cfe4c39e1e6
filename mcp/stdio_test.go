package mcp_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/mcp"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/tests/wait"
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

// The transport and the SDK read a message alike: a key the SDK reads only in its exact case ("ID",
// "Method") must not make the transport wait at the end of its input for an answer the SDK never
// sends (it read a notification, or a response), and what the SDK cannot decode ("JSONRPC", a
// method that is no string, nesting past its depth limit) is refused on its own, the session
// going on. Each case ends with stdin; a hang fails the test.
func TestStdioReadsMessagesAsTheSDKDoes(t *testing.T) {
	initialize := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"1"}}}` + "\n" +
		`{"jsonrpc":"2.0","method":"notifications/initialized"}` + "\n"
	deep := strings.Repeat("[", 1001) + strings.Repeat("]", 1001)
	for name, tc := range map[string]struct{ msg, answer string }{
		"ID":           {`{"jsonrpc":"2.0","ID":2,"method":"ping"}`, ""},
		"Method":       {`{"jsonrpc":"2.0","id":2,"Method":"ping"}`, ""},
		"JSONRPC":      {`{"JSONRPC":"2.0","id":2,"method":"ping"}`, `"id":2,"error"`},
		"method 5":     {`{"jsonrpc":"2.0","id":2,"method":5}`, `"id":2,"error"`},
		"deep":         {`{"jsonrpc":"2.0","id":2,"method":"ping","params":{"a":` + deep + `}}`, `"id":2,"error"`},
		"RequestId":    {`{"jsonrpc":"2.0","id":2,"method":"ping"}` + "\n" + `{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"RequestId":2}}`, `"id":2,"result"`},
		"cancel by id": {`{"jsonrpc":"2.0","id":2,"method":"tools/list"}` + "\n" + `{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":2}}`, ""},
	} {
		t.Run(name, func(t *testing.T) {
			in := initialize + tc.msg + "\n" + `{"jsonrpc":"2.0","id":"last","method":"ping"}` + "\n"
			out := &wait.Buffer{}
			srv := mcp.NewServer(nil, mcp.Options{Scopes: []string{protocol.ScopeFSRead}})
			done := make(chan error, 1)
			go func() { done <- srv.Run(t.Context(), mcp.StdioTransport(strings.NewReader(in), out)) }()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("run: %v", err)
				}
			case <-time.After(30 * time.Second): // fails the test instead of hanging it
				t.Fatalf("the server still runs 30 s after the end of its input:\n%s", out.String())
			}
			got := out.String()
			if !strings.Contains(got, `"id":"last","result"`) {
				t.Errorf("the session ended before the last request:\n%s", got)
			}
			if tc.answer != "" && !strings.Contains(got, tc.answer) {
				t.Errorf("no %s:\n%s", tc.answer, got)
			}
		})
	}
}
