package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
)

// mcpRows times a small read (6 bytes) as an MCP tool call over Streamable HTTP (the official Go
// SDK's client) and as the same read on the dataplane, in alternating rounds so that both see the
// same load, and prints the MCP overhead (the difference of the medians) beside issue 14's target,
// with the broker's CPU time per call of each.
func mcpRows(ctx context.Context, m protocol.MintResponse, n int, br *brokerProc, add func(row)) {
	fmt.Fprintln(os.Stderr, "MCP...")
	res, err := mcpToolCall(ctx, m, n, br)
	if err != nil {
		fmt.Fprintln(os.Stderr, "  MCP tool call:", err)
		return
	}
	over := res.mcp.pct(.5) - res.dp.pct(.5)
	add(row{"MCP tool call (read_file, Streamable HTTP)", res.mcp.ms(), "< 0.3 ms over the dataplane", "", "",
		fmt.Sprintf("the same read on the dataplane %s: MCP adds %.3f ms (target < 0.3); broker CPU per call %.0f us, dataplane %.0f us",
			res.dp.ms(), over.Seconds()*1000, us(res.mcpCPU), us(res.dpCPU))})
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

type mcpResult struct {
	mcp, dp       samples
	mcpCPU, dpCPU time.Duration // the broker's CPU time per call
}

func mcpToolCall(ctx context.Context, m protocol.MintResponse, n int, br *brokerProc) (res mcpResult, err error) {
	r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		return res, err
	}
	defer r.Close()
	if _, err = r.Write(ctx, protocol.WriteArgs{Path: "mcp.txt", Content: "hello\n"}); err != nil {
		return res, err
	}
	hc := &http.Client{Transport: bearer{m.Token}}
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "bench", Version: "0"}, nil).Connect(ctx,
		&sdk.StreamableClientTransport{Endpoint: m.Sandbox.MCPURL, HTTPClient: hc}, nil)
	if err != nil {
		return res, err
	}
	defer cs.Close()
	args := map[string]any{"file_path": "mcp.txt"}
	mcpCall := func() error {
		out, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: "read_file", Arguments: args})
		if err == nil && out.IsError {
			err = fmt.Errorf("read_file failed")
		}
		return err
	}
	dpCall := func() error {
		_, err := r.Read(ctx, protocol.ReadArgs{Path: "mcp.txt"})
		return err
	}
	for range 100 { // warm up
		mcpCall()
		dpCall()
	}
	const rounds = 10
	var mcpCPU, dpCPU time.Duration
	for range rounds {
		c := br.cpuTime()
		res.mcp.add(sample(n/rounds, mcpCall))
		d := br.cpuTime()
		res.dp.add(sample(n/rounds, dpCall))
		mcpCPU += d - c
		dpCPU += br.cpuTime() - d
	}
	res.mcp.sort()
	res.dp.sort()
	res.mcpCPU = mcpCPU / time.Duration(max(len(res.mcp.d), 1))
	res.dpCPU = dpCPU / time.Duration(max(len(res.dp.d), 1))
	return res, nil
}

var mcpOnly = flag("mcp-only", "only the MCP tool call row")

func mcpOnlyRun(ctx context.Context, m protocol.MintResponse, n int, br *brokerProc) error {
	var out []row
	mcpRows(ctx, m, n, br, func(r row) { out = append(out, r) })
	if len(out) == 0 {
		return fmt.Errorf("no MCP row")
	}
	for _, r := range out {
		fmt.Printf("%s: %s (budget %s; %s)\n", r.metric, r.ours, r.budget, r.baseline)
	}
	return nil
}

type bearer struct{ token string }

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return http.DefaultTransport.RoundTrip(r)
}
