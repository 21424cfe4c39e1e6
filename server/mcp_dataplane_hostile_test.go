package server_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sbxbroker/broker/mcp"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
)

// TestLocalConnRefusesStreamingOps: the in-process connection has no writer and no socket, so an
// op that sends frames of its own (a shell's terminal output, an upload's end) must be refused
// before it runs, whatever class the op table gives it: a shell there dereferenced the missing
// queue and took the broker down.
func TestLocalConnRefusesStreamingOps(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, _ := newSandbox(t, b, "local-shell")
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	conn, err := server.OpenLocal(b.Server, ctx, mcp.Identity{Token: b.Client.APIKey(), SandboxID: id}, "test")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	calls := []struct {
		op   string
		args any
	}{
		{protocol.OpShell, protocol.ShellArgs{Argv: []string{"sh", "-c", "echo out; touch shell-ran"}}},
		{protocol.OpShell, protocol.ShellArgs{}},
		{protocol.OpResize, protocol.ResizeArgs{Rows: 10, Cols: 10}},
		{protocol.OpUpload, map[string]any{"path": "up.txt"}},
		{protocol.OpDownload, protocol.ReadArgs{Path: "x"}},
		{protocol.OpCancel, struct{}{}},
	}
	for _, c := range calls {
		_, err := conn.Call(ctx, c.op, c.args)
		var pe *protocol.Error
		if !errors.As(err, &pe) || pe.Code != protocol.CodeUnknownOp {
			t.Errorf("%s in process: %v, want unknown_op", c.op, err)
		}
	}
	var pe *protocol.Error
	if _, err := conn.Call(ctx, protocol.OpStat, protocol.StatArgs{Path: "shell-ran"}); !errors.As(err, &pe) || pe.Code != protocol.CodeFileNotFound {
		t.Errorf("the refused shell ran: stat says %v", err)
	}
	if _, err := conn.Call(ctx, protocol.OpExec, protocol.ExecArgs{Command: "true"}); err != nil {
		t.Errorf("the connection is unusable after the refusals: %v", err)
	}
}
