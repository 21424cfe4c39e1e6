package mcp_test

import (
	"errors"
	"syscall"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/mcp"
	"github.com/sbxbroker/broker/protocol"
)

// cpuTime is the process's user and system CPU time so far: the broker runs in this process, so a
// call's CPU time/op counts both ends, and unlike ns/op it does not grow with other processes' load.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// loop runs call b.N times and reports its CPU time per call beside ns/op.
func loop(b *testing.B, call func() error) {
	start := cpuTime()
	for b.Loop() {
		if err := call(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(cpuTime()-start)/float64(b.N)/1e3, "cpu-us/op")
}

// BenchmarkToolCall measures one small read (a 6-byte file) on loopback: straight on the dataplane
// (the floor), through the MCP server on an in-memory transport over that dataplane connection (the
// SDK's cost, as sbctl mcp pays it), and over Streamable HTTP on the broker, whose sessions run
// their calls on an in-process dataplane connection (what an agent server's MCP client pays). The
// MCP overhead is the difference to the floor; client and server share this process, so cpu-us/op
// counts both ends (tests/bench prints the broker's share alone).
func BenchmarkToolCall(b *testing.B) {
	f := newFixture(b)
	m, err := f.b.Client.Delegate(b.Context(), f.sbx.ID, protocol.MintRequest{Scopes: protocol.Scopes})
	if err != nil {
		b.Fatal(err)
	}
	dp, err := backend.Dial(b.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		b.Fatal(err)
	}
	defer dp.Close()
	if _, err := dp.Call(b.Context(), protocol.OpWrite, protocol.WriteArgs{Path: "bench.txt", Content: "hello\n"}); err != nil {
		b.Fatal(err)
	}
	args := map[string]any{"file_path": "bench.txt"}

	b.Run("dataplane", func(b *testing.B) {
		loop(b, func() error {
			_, err := dp.Call(b.Context(), protocol.OpRead, protocol.ReadArgs{Path: "bench.txt"})
			return err
		})
	})
	b.Run("mcp-in-process", func(b *testing.B) {
		srv := mcp.NewServer(dp, mcp.Options{Scopes: protocol.Scopes})
		st, ct := sdk.NewInMemoryTransports()
		ss, err := srv.Connect(b.Context(), st, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer ss.Close()
		cs, err := sdk.NewClient(&sdk.Implementation{Name: "bench"}, nil).Connect(b.Context(), ct, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer cs.Close()
		loop(b, func() error { return callRead(b, cs, args) })
	})
	b.Run("mcp-streamable-http", func(b *testing.B) {
		cs := f.connect(b, m.Token, nil)
		loop(b, func() error { return callRead(b, cs, args) })
	})
}

func callRead(b *testing.B, cs *sdk.ClientSession, args map[string]any) error {
	r, err := cs.CallTool(b.Context(), &sdk.CallToolParams{Name: "read_file", Arguments: args})
	if err == nil && r.IsError {
		err = errors.New(text(r))
	}
	return err
}
