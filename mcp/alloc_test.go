package mcp

import (
	"context"
	"encoding/json"
	"runtime"
	"testing"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/protocol"
)

type constDataplane struct{}

func (constDataplane) Call(context.Context, string, any) (json.RawMessage, error) {
	return json.RawMessage(`{"path":"/workspace/a.txt","content":"hello\n","size":6}`), nil
}

// A tool call allocates a few KiB in the SDK (client and server together), not the ~390 KiB it
// did when each of its ten or so unmarshals allocated a 32 KiB read buffer: that garbage was most
// of an MCP call's CPU time (third_party/go-sdk/PATCH.md). This fails if the SDK is upgraded or
// the replace in go.mod is dropped while the SDK still does it.
func TestToolCallAllocatesLittle(t *testing.T) {
	st, ct := sdk.NewInMemoryTransports()
	ss, err := NewServer(constDataplane{}, Options{Scopes: protocol.Scopes}).Connect(t.Context(), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test"}, nil).Connect(t.Context(), ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	call := func() {
		r, err := cs.CallTool(t.Context(), &sdk.CallToolParams{Name: ToolRead, Arguments: map[string]any{"file_path": "a.txt"}})
		if err != nil || r.IsError {
			t.Fatalf("read_file: %v %v", err, r)
		}
	}
	call()
	const n = 200
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		call()
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / n; per > 96<<10 {
		t.Errorf("a tool call allocated %d KiB (client and server); the SDK's unmarshals allocate a 32 KiB buffer each again", per>>10)
	}
}
