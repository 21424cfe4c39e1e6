package main

import (
	"encoding/json"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// sbctl mcp serves the sandbox's tools over stdio with a token of the asked scopes, renews the
// token before it expires (the session goes on past the first token's expiry), and revokes the
// token it holds when stdin ends.
func TestMCPStdioRenewsAndRevokes(t *testing.T) {
	b := servertest.New(t, servertest.Options{})
	res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "mcp"})
	if err != nil {
		t.Fatal(err)
	}
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	var stderr wait.Buffer
	exited := make(chan int, 1)
	go func() {
		code := run(t.Context(), []string{"--broker", b.URL, "--api-key", b.Client.APIKey(), "--config", filepath.Join(t.TempDir(), "none.yaml"),
			"mcp", "mcp", "--scope", "fs:read,fs:write", "--expires", "3s"}, inR, outW, &stderr)
		outW.Close()
		exited <- code
	}()
	c := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "v0"}, nil)
	cs, err := c.Connect(t.Context(), &sdk.IOTransport{Reader: outR, Writer: inW}, nil)
	if err != nil {
		t.Fatalf("connect: %v (stderr %s)", err, stderr.String())
	}
	tools, err := cs.ListTools(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tl := range tools.Tools {
		names = append(names, tl.Name)
	}
	slices.Sort(names)
	if want := []string{"edit_file", "glob", "grep", "ls", "read_file", "write_file"}; !slices.Equal(names, want) {
		t.Errorf("tools %v, want %v (no execute without exec)", names, want)
	}
	callOK := func() {
		t.Helper()
		r, err := cs.CallTool(t.Context(), &sdk.CallToolParams{Name: "write_file", Arguments: map[string]any{"file_path": "x", "content": "y"}})
		if err != nil || r.IsError {
			t.Fatalf("write_file: %v %+v", err, r)
		}
	}
	callOK()
	first, err := b.Client.ListDelegations(t.Context(), res.Sandbox.ID)
	if err != nil || len(first.Items) != 1 {
		t.Fatalf("delegations: %v %+v", err, first)
	}
	// Renewal revokes the first token once the second is in use.
	deadline := time.Now().Add(20 * time.Second)
	for {
		d, err := b.Client.ListDelegations(t.Context(), res.Sandbox.ID)
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(d.Items, func(x protocol.Delegation) bool { return x.JTI == first.Items[0].JTI })
		if i < 0 || d.Items[i].Revoked {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the first token was not renewed: %+v\n%s", d, stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Past the first token's expiry, the session goes on.
	for time.Now().Before(first.Items[0].ExpiresAt.Add(200 * time.Millisecond)) {
		time.Sleep(50 * time.Millisecond)
	}
	callOK()
	inW.Close()
	select {
	case code := <-exited:
		if code != 0 {
			t.Errorf("sbctl mcp exited %d: %s", code, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("sbctl mcp did not exit when stdin ended")
	}
	d, err := b.Client.ListDelegations(t.Context(), res.Sandbox.ID)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range d.Items {
		if !x.Revoked && x.ExpiresAt.After(time.Now()) {
			t.Errorf("token %s still active after sbctl mcp exited", x.JTI)
		}
	}
}

// mcp config prints JSON a client reads (alone on stdout, so it can be redirected into the file),
// naming this sbctl, the broker and the flags, and no credential.
func TestMCPConfigSnippets(t *testing.T) {
	t.Parallel()
	for client, top := range map[string]string{"claude-code": "mcpServers", "cursor": "mcpServers", "vscode": "servers"} {
		code, stdout, stderr := sbctl(t, t.Context(), "http://127.0.0.1:7070", "", "mcp", "config", "dev", "--client", client, "--scope", "fs:read,exec", "--allow-cmd", "pytest")
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", client, code, stderr)
		}
		var doc map[string]map[string]struct {
			Command string   `json:"command"`
			Args    []string `json:"args"`
		}
		if err := json.Unmarshal([]byte(stdout), &doc); err != nil {
			t.Fatalf("%s: stdout is not JSON: %v\n%s", client, err, stdout)
		}
		srv, ok := doc[top]["sandbox-dev"]
		joined := strings.Join(srv.Args, " ")
		if !ok || srv.Command == "" || !strings.HasPrefix(joined, "mcp dev ") || strings.Contains(stdout, "sbk_") ||
			!strings.Contains(joined, "--broker http://127.0.0.1:7070") || !strings.Contains(joined, "--scope fs:read,exec") ||
			!strings.Contains(joined, "--allow-cmd pytest") {
			t.Errorf("%s: %s", client, stdout)
		}
	}
	if code, _, _ := sbctl(t, t.Context(), "http://127.0.0.1:7070", "", "mcp", "config", "dev", "--client", "emacs"); code != exitUsage {
		t.Errorf("an unknown client: exit %d, want %d", code, exitUsage)
	}
}
