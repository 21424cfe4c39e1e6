package server_test

// Hostile-input tests of the dataplane's credentials and policy: scopes, the command allowlist,
// revocation, expiry and the checks at upgrade (docs/dataplane.md §1, §3, §6). The raw-protocol
// helpers (rawConn, dialRaw, ...) are in dataplane_hostile_test.go.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// treeSnapshot maps every path under dir to its type, permission bits and content, to prove that a
// refused request changed nothing on disk.
func treeSnapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	snap := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		v := fi.Mode().String()
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			v += " -> " + target
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			v += " " + string(b)
		}
		snap[rel] = v
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return snap
}

func sameTree(t *testing.T, what string, before, after map[string]string) {
	t.Helper()
	for k, v := range before {
		if after[k] != v {
			t.Errorf("%s: %s changed: %q -> %q", what, k, v, after[k])
		}
	}
	for k, v := range after {
		if _, ok := before[k]; !ok {
			t.Errorf("%s: %s appeared: %q", what, k, v)
		}
	}
}

// opCall is one dataplane request of a scope table.
type opCall struct {
	op   string
	args any
}

// Every operation once, against the files seedScopeFiles makes.
var everyOp = []opCall{
	{"stat", map[string]any{"path": "a.txt"}},
	{"ls", map[string]any{"path": "/workspace"}},
	{"read", map[string]any{"path": "a.txt"}},
	{"glob", map[string]any{"pattern": "**/*.txt"}},
	{"grep", map[string]any{"pattern": "alpha"}},
	{"download", map[string]any{"path": "a.txt"}},
	{"env", nil},
	{"edit", map[string]any{"path": "a.txt", "old": "alpha", "new": "omega"}},
	{"write", map[string]any{"path": "a.txt", "content": "overwritten"}},
	{"write", map[string]any{"path": "new.txt", "content": "new"}},
	{"move", map[string]any{"from": "new.txt", "to": "moved.txt"}},
	{"delete", map[string]any{"path": "a.txt"}},
	{"delete", map[string]any{"path": "dir", "recursive": true}},
	{"mkdir", map[string]any{"path": "made/deep", "parents": true}},
	{"upload", map[string]any{"path": "up.txt"}},
	{"exec", map[string]any{"command": "echo ran > ran.txt; echo ok"}},
	{"shell", map[string]any{"argv": []string{"sh", "-c", "echo ran > ran-shell.txt"}}},
}

func seedScopeFiles(t *testing.T, ws string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(ws, "dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{"a.txt": "alpha\nbeta\n", "dir/b.txt": "alpha in b\n"} {
		if err := os.WriteFile(filepath.Join(ws, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestDataplaneScopes(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	read := []string{"stat", "ls", "read", "glob", "grep", "download", "env"}
	write := []string{"write", "edit", "delete", "mkdir", "move", "upload"}
	cases := []struct {
		name    string
		scopes  []string
		allowed []string // every other op must be scope_denied
	}{
		{"fs:read only", []string{"fs:read"}, read},
		{"exec only", []string{"exec"}, []string{"exec", "shell"}},
		{"fs:write only", []string{"fs:write"}, write},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			name := "scopes-" + strings.NewReplacer(":", "", " ", "-").Replace(tc.name)
			res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: name})
			if err != nil {
				t.Fatal(err)
			}
			ws := workspaceDir(b, res.Sandbox.ID)
			seedScopeFiles(t, ws)
			m, err := b.Client.Delegate(t.Context(), name, protocol.MintRequest{Scopes: tc.scopes})
			if err != nil {
				t.Fatal(err)
			}
			c := dialRaw(t, m.Sandbox.DataplaneURL, m.Token)
			if !slices.Equal(c.hello.Scopes, tc.scopes) {
				t.Errorf("hello scopes %v, want %v", c.hello.Scopes, tc.scopes)
			}
			for i, call := range everyOp {
				if slices.Contains(tc.allowed, call.op) {
					continue
				}
				before := treeSnapshot(t, ws)
				id := uint32(100 + i)
				got := c.call(id, call.op, call.args)
				if got.code() != protocol.CodeScopeDenied {
					t.Errorf("%s %v: want scope_denied, got %s", call.op, call.args, got)
				}
				if call.op == "upload" {
					// The data and end frames a client sends after its upload request must not write
					// anything either: they are stray frames, answered invalid_argument.
					c.sendBinary(dataFrame(protocol.FrameData, id, []byte("smuggled")))
					if got := c.await(0); got.code() != protocol.CodeInvalidArgument {
						t.Errorf("data frame after a denied upload: %s", got)
					}
					c.sendBinary(dataFrame(protocol.FrameEnd, id, nil))
					if got := c.await(0); got.code() != protocol.CodeInvalidArgument {
						t.Errorf("end frame after a denied upload: %s", got)
					}
				}
				sameTree(t, call.op, before, treeSnapshot(t, ws))
			}
			// Allowed operations work (the mutating ones last, in table order).
			for i, call := range everyOp {
				if !slices.Contains(tc.allowed, call.op) {
					continue
				}
				id := uint32(200 + i)
				var got answer
				if call.op == "upload" {
					c.sendJSON(protocol.Request{ID: id, Op: "upload", Args: call.args})
					c.sendBinary(dataFrame(protocol.FrameData, id, []byte("uploaded")))
					c.sendBinary(dataFrame(protocol.FrameEnd, id, nil))
					got = c.await(id)
				} else {
					got = c.call(id, call.op, call.args)
				}
				if got.Error != nil {
					t.Errorf("%s %v: allowed by %v, got %s", call.op, call.args, tc.scopes, got)
				}
			}
			c.ping()
			if tc.name == "exec only" {
				for _, f := range []string{"ran.txt", "ran-shell.txt"} {
					if _, err := os.Stat(filepath.Join(ws, f)); err != nil {
						t.Errorf("exec or shell did not run: %v", err)
					}
				}
			}
			assertAlive(t, b, m.Sandbox.DataplaneURL, m.Token)
		})
	}
}

func TestDataplaneCommandAllowlist(t *testing.T) {
	t.Parallel()
	// The namespace provider, so that /workspace inside is the workspace on disk and a marker a
	// bypass creates would really appear.
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	ctx := t.Context()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "allow"})
	if err != nil {
		t.Fatal(err)
	}
	ws := workspaceDir(b, res.Sandbox.ID)
	owner := dialRaw(t, b.Client.DataplaneURL("allow"), b.Client.APIKey())
	// A control: the marker technique works, so an absent marker means the command did not run.
	if got := owner.call(1, "exec", map[string]any{"command": "touch /workspace/control"}); got.Error != nil {
		t.Fatalf("control exec: %s", got)
	}
	if _, err := os.Stat(filepath.Join(ws, "control")); err != nil {
		t.Fatalf("control marker missing, the test cannot see bypasses: %v", err)
	}
	// A planted ./pytest that would leave a marker if it ever ran.
	planted := "#!/bin/sh\ntouch /workspace/pwned-planted\n"
	if got := owner.call(2, "write", map[string]any{"path": "pytest", "content": planted}); got.Error != nil {
		t.Fatal(got)
	}
	if got := owner.call(3, "exec", map[string]any{"argv": []string{"chmod", "755", "/workspace/pytest"}}); got.Error != nil {
		t.Fatal(got)
	}

	m, err := b.Client.Delegate(ctx, "allow", protocol.MintRequest{Scopes: []string{"exec"}, AllowCmd: []string{"pytest"}})
	if err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, m.Sandbox.DataplaneURL, m.Token)
	if !slices.Equal(c.hello.AllowCmd, []string{"pytest"}) {
		t.Errorf("hello allow_cmd: %v", c.hello.AllowCmd)
	}

	// pytest itself gets past the policy; it is not installed, so the shell answers 127 (and the
	// planted /workspace/pytest is not what PATH finds, even with cwd /workspace).
	for i, args := range []map[string]any{
		{"command": "pytest -q"},
		{"argv": []string{"pytest", "-q"}},
		{"command": "pytest -q", "cwd": "/workspace"},
		{"command": `"pytest" -q`},
		{"command": "py'test' -q"},
	} {
		got := c.call(uint32(10+i), "exec", args)
		var r protocol.ExecResult
		if got.Error != nil || got.decode(&r) != nil || r.ExitCode != 127 {
			t.Errorf("%v: want exit 127, got %s", args, got)
		}
	}

	bypasses := []struct {
		name string
		args map[string]any
	}{
		{"semicolon", map[string]any{"command": "pytest; touch /workspace/pwned-semicolon"}},
		{"and", map[string]any{"command": "pytest && touch /workspace/pwned-and"}},
		{"or", map[string]any{"command": "pytest || touch /workspace/pwned-or"}},
		{"pipe to sh", map[string]any{"command": "pytest | sh", "stdin": "touch /workspace/pwned-pipe"}},
		{"pipe", map[string]any{"command": "pytest | touch /workspace/pwned-pipe2"}},
		{"command substitution", map[string]any{"command": "pytest $(touch /workspace/pwned-subst)"}},
		{"backticks", map[string]any{"command": "pytest `touch /workspace/pwned-backtick`"}},
		{"substitution in double quotes", map[string]any{"command": `pytest "$(touch /workspace/pwned-dq)"`}},
		{"redirect out", map[string]any{"command": "pytest > /workspace/pwned-redirect"}},
		{"redirect append", map[string]any{"command": "pytest >> /workspace/pwned-append"}},
		{"redirect in", map[string]any{"command": "pytest < /etc/passwd"}},
		{"newline", map[string]any{"command": "pytest\ntouch /workspace/pwned-newline"}},
		{"carriage return", map[string]any{"command": "pytest\rtouch /workspace/pwned-cr"}},
		{"background", map[string]any{"command": "pytest & touch /workspace/pwned-amp"}},
		{"subshell", map[string]any{"command": "(pytest)"}},
		{"subshell touch", map[string]any{"command": "(touch /workspace/pwned-subshell)"}},
		{"assignment", map[string]any{"command": "PATH=/tmp pytest"}},
		{"assignment after blanks", map[string]any{"command": "  PATH=/workspace pytest"}},
		{"relative path", map[string]any{"command": "./pytest"}},
		{"absolute path", map[string]any{"command": "/workspace/pytest"}},
		{"argv relative path", map[string]any{"argv": []string{"./pytest"}}},
		{"argv sh -c", map[string]any{"argv": []string{"sh", "-c", "touch /workspace/pwned-argv"}}},
		{"argv NUL", map[string]any{"argv": []string{"pytest", "a\x00b"}}},
		{"env", map[string]any{"command": "pytest", "env": map[string]string{"PYTHONSTARTUP": "/workspace/pwned"}}},
		{"env PATH", map[string]any{"command": "pytest", "env": map[string]string{"PATH": "/workspace"}}},
		{"env with argv", map[string]any{"argv": []string{"pytest"}, "env": map[string]string{"PATH": "/workspace"}}},
		{"escaped semicolon", map[string]any{"command": `pytest \; touch /workspace/pwned-escaped`}},
		{"comment", map[string]any{"command": "# pytest\ntouch /workspace/pwned-comment"}},
		{"NUL", map[string]any{"command": "pytest\x00; touch /workspace/pwned-nul"}},
		{"another program", map[string]any{"command": "touch /workspace/pwned-other"}},
		{"both forms", map[string]any{"command": "pytest", "argv": []string{"sh", "-c", "touch /workspace/pwned-both"}}},
		{"background flag on another program", map[string]any{"command": "touch /workspace/pwned-bg", "background": true}},
	}
	for i, bp := range bypasses {
		got := c.call(uint32(100+i), "exec", bp.args)
		if got.code() != protocol.CodeCommandNotAllowed {
			t.Errorf("%s: want command_not_allowed, got %s", bp.name, got)
		}
	}
	// Every attempt was answered, so a foreground one that ran has left its marker already; one
	// that started in the background is a started process whose touch takes milliseconds: a
	// second is far longer than it needs.
	wait.Never(t, time.Second, func() bool {
		entries, _ := os.ReadDir(ws)
		return slices.ContainsFunc(entries, func(e os.DirEntry) bool { return strings.HasPrefix(e.Name(), "pwned") })
	}, "a bypass ran: a pwned marker exists in the workspace")
	if got := c.call(999, "exec", map[string]any{"command": "pytest"}); got.Error != nil {
		t.Errorf("connection unusable after the bypass attempts: %s", got)
	}
	assertAlive(t, b, m.Sandbox.DataplaneURL, m.Token)
}

// closeWatch reads a connection until it ends and reports the close frame and when it came.
func closeWatch(c *rawConn) <-chan closeInfo {
	ch := make(chan closeInfo, 1)
	go func() {
		for {
			if _, _, err := c.ws.ReadMessage(); err != nil {
				info := closeInfo{at: time.Now(), err: err}
				var ce *websocket.CloseError
				if errors.As(err, &ce) {
					info.code, info.reason = ce.Code, ce.Text
				}
				ch <- info
				return
			}
		}
	}()
	return ch
}

type closeInfo struct {
	at     time.Time
	code   int
	reason string
	err    error
}

func TestDataplaneCredentialEndsCloseConnections(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	cases := []struct {
		name    string
		owner   bool // the connection uses the owner's API key instead of a token
		end     func(t *testing.T, name, jti string)
		codes   []int
		reasons []string
		// redial is what a new dial with the same credential gets afterwards.
		redialStatus int
		redialCode   string
	}{
		{"revoke", false, func(t *testing.T, name, jti string) {
			if _, err := b.Client.Revoke(t.Context(), name, jti); err != nil {
				t.Fatal(err)
			}
		}, []int{4001}, []string{"token_revoked"}, 401, "token_revoked"},
		{"revoke all", false, func(t *testing.T, name, _ string) {
			if _, err := b.Client.RevokeAll(t.Context(), name); err != nil {
				t.Fatal(err)
			}
		}, []int{4001}, []string{"token_revoked"}, 401, "token_revoked"},
		{"delete", false, func(t *testing.T, name, _ string) {
			if _, err := b.Client.DeleteSandbox(t.Context(), name); err != nil {
				t.Fatal(err)
			}
		}, []int{4001, 4002}, []string{"token_revoked", "sandbox_not_running", "not_found"}, 401, "token_revoked"},
		{"stop", false, func(t *testing.T, name, _ string) {
			if _, err := b.Client.StopSandbox(t.Context(), name); err != nil {
				t.Fatal(err)
			}
		}, []int{4002}, []string{"sandbox_not_running"}, 409, "sandbox_not_running"},
		{"stop, owner key", true, func(t *testing.T, name, _ string) {
			if _, err := b.Client.StopSandbox(t.Context(), name); err != nil {
				t.Fatal(err)
			}
		}, []int{4002}, []string{"sandbox_not_running"}, 409, "sandbox_not_running"},
		{"delete, owner key", true, func(t *testing.T, name, _ string) {
			if _, err := b.Client.DeleteSandbox(t.Context(), name); err != nil {
				t.Fatal(err)
			}
		}, []int{4002}, []string{"sandbox_not_running", "not_found"}, 404, "not_found"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			name := fmt.Sprintf("end-%d", i)
			if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: name}); err != nil {
				t.Fatal(err)
			}
			m, err := b.Client.Delegate(t.Context(), name, protocol.MintRequest{Scopes: []string{"fs:read", "exec"}})
			if err != nil {
				t.Fatal(err)
			}
			cred := m.Token
			if tc.owner {
				cred = b.Client.APIKey()
			}
			c := dialRaw(t, m.Sandbox.DataplaneURL, cred)
			// A request in flight when the credential ends must not keep the connection open.
			c.sendJSON(protocol.Request{ID: 1, Op: "exec", Args: map[string]any{"command": "sleep 30"}})
			c.ping()
			closed := closeWatch(c)
			start := time.Now()
			tc.end(t, name, m.JTI)
			select {
			case got := <-closed:
				took := got.at.Sub(start)
				if took > time.Second {
					t.Errorf("closed %s after the %s call, want within 1s", took, tc.name)
				}
				if !slices.Contains(tc.codes, got.code) || !slices.Contains(tc.reasons, got.reason) {
					t.Errorf("close %d %q (%v), want one of %v %v", got.code, got.reason, got.err, tc.codes, tc.reasons)
				}
				t.Logf("%s: closed %d %q after %s", tc.name, got.code, got.reason, took)
			case <-time.After(5 * time.Second):
				t.Fatalf("the connection is still open 5s after %s", tc.name)
			}
			status, eb := dialStatus(t, m.Sandbox.DataplaneURL, authHeader(cred), []string{protocol.Subprotocol})
			if status != tc.redialStatus || eb.Error.Code != tc.redialCode {
				t.Errorf("redial: %d %+v, want %d %s", status, eb, tc.redialStatus, tc.redialCode)
			}
			if _, err := b.Client.ListAllSandboxes(t.Context(), client.ListOptions{}); err != nil {
				t.Errorf("REST after %s: %v", tc.name, err)
			}
		})
	}
}

func TestDataplaneTokenExpiry(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "expiring"}); err != nil {
		t.Fatal(err)
	}
	ttl := int64(2)
	m, err := b.Client.Delegate(t.Context(), "expiring", protocol.MintRequest{Scopes: []string{"fs:read"}, TTLSeconds: &ttl})
	if err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, m.Sandbox.DataplaneURL, m.Token)
	if c.hello.ExpiresAt == nil || !c.hello.ExpiresAt.Equal(m.ExpiresAt) {
		t.Fatalf("hello expires_at %v, minted %v", c.hello.ExpiresAt, m.ExpiresAt)
	}
	c.ping()
	select {
	case got := <-closeWatch(c):
		late := got.at.Sub(m.ExpiresAt)
		if late < -50*time.Millisecond || late > time.Second {
			t.Errorf("closed %s after exp, want within 1s of it", late)
		}
		if got.code != protocol.CloseCredentialEnded || got.reason != protocol.CodeTokenExpired {
			t.Errorf("close %d %q (%v), want 4001 token_expired", got.code, got.reason, got.err)
		}
	case <-time.After(time.Until(m.ExpiresAt) + 5*time.Second):
		t.Fatal("the connection outlived its token by 5s")
	}
	// An expired token gets nothing more: not a new connection, and not requests pipelined behind
	// the handshake of one (the verifier's clock-skew leeway must not extend the token's life here).
	var reqs []protocol.Request
	for i := 1; i <= 20; i++ {
		reqs = append(reqs, protocol.Request{ID: uint32(i), Op: "ls", Args: map[string]any{"path": "/workspace"}})
	}
	for try := 0; try < 10; try++ {
		ws, status, eb := dialPipelined(t, m.Sandbox.DataplaneURL, m.Token, reqs)
		if ws == nil {
			if status != 401 || eb.Error.Code != protocol.CodeTokenExpired {
				t.Fatalf("redial of an expired token: %d %+v, want 401 token_expired", status, eb)
			}
			continue
		}
		served := 0
		for {
			_, data, err := ws.ReadMessage()
			if err != nil {
				break
			}
			var a answer
			if json.Unmarshal(data, &a) == nil && a.ID != 0 && a.Error == nil {
				served++
			}
		}
		ws.Close()
		t.Errorf("try %d: an expired token was upgraded; %d of its pipelined requests were served", try, served)
	}
	assertAlive(t, b, b.Client.DataplaneURL("expiring"), b.Client.APIKey())
}

func TestDataplaneUpgradeChecks(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	ctx := t.Context()
	a, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "sbx-a"})
	if err != nil {
		t.Fatal(err)
	}
	bb, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "sbx-b"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "sbx-stopped"}); err != nil {
		t.Fatal(err)
	}
	mA, err := b.Client.Delegate(ctx, "sbx-a", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	mStopped, err := b.Client.Delegate(ctx, "sbx-stopped", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.StopSandbox(ctx, "sbx-stopped"); err != nil {
		t.Fatal(err)
	}
	urlA, urlB := dataplaneURL(b, a.Sandbox.ID), dataplaneURL(b, bb.Sandbox.ID)
	other := b.NewClient("org-other")
	// A well-formed signature of the right length with one character changed.
	dot := strings.LastIndexByte(mA.Token, '.')
	sig := []byte(mA.Token[dot+1:])
	if sig[5] == 'A' {
		sig[5] = 'B'
	} else {
		sig[5] = 'A'
	}
	tampered := mA.Token[:dot+1] + string(sig)
	proto := []string{protocol.Subprotocol}
	withOrigin := func(h http.Header, origin string) http.Header { h.Set("Origin", origin); return h }

	cases := []struct {
		name   string
		url    string
		hdr    http.Header
		protos []string
		status int
		code   string
	}{
		{"no credentials", urlA, http.Header{}, proto, 401, "unauthenticated"},
		{"empty bearer", urlA, http.Header{"Authorization": {"Bearer "}}, proto, 401, "unauthenticated"},
		{"token in the URL", urlA + "?token=" + mA.Token, authHeader(mA.Token), proto, 400, "invalid_argument"},
		{"access_token in the URL", urlA + "?access_token=x", authHeader(mA.Token), proto, 400, "invalid_argument"},
		{"api_key in the URL", urlA + "?api_key=x", authHeader(mA.Token), proto, 400, "invalid_argument"},
		{"key in the URL", urlA + "?key=x", authHeader(mA.Token), proto, 400, "invalid_argument"},
		{"credential in the URL", urlA + "?credential=x", authHeader(mA.Token), proto, 400, "invalid_argument"},
		{"no subprotocol", urlA, authHeader(mA.Token), nil, 400, "invalid_argument"},
		{"wrong subprotocol", urlA, authHeader(mA.Token), []string{"sbx.other.v2"}, 400, "invalid_argument"},
		{"older subprotocol", urlA, authHeader(mA.Token), []string{"sbx.dataplane.v1"}, 400, "invalid_argument"},
		{"bearer subprotocol only", urlA, http.Header{}, []string{protocol.BearerSubprotocolPrefix + mA.Token}, 400, "invalid_argument"},
		{"origin not allowed", urlA, withOrigin(authHeader(mA.Token), "https://evil.example"), proto, 403, "forbidden"},
		{"browser form, origin not allowed", urlA, withOrigin(http.Header{}, "https://evil.example"),
			[]string{protocol.Subprotocol, protocol.BearerSubprotocolPrefix + mA.Token}, 403, "forbidden"},
		{"token for another sandbox", urlB, authHeader(mA.Token), proto, 404, "not_found"},
		{"another org's API key", urlA, authHeader(other.APIKey()), proto, 404, "not_found"},
		{"another org's API key, by name", dataplaneURL(b, "sbx-a"), authHeader(other.APIKey()), proto, 404, "not_found"},
		{"stopped sandbox, token", mStopped.Sandbox.DataplaneURL, authHeader(mStopped.Token), proto, 409, "sandbox_not_running"},
		{"stopped sandbox, owner", dataplaneURL(b, "sbx-stopped"), authHeader(b.Client.APIKey()), proto, 409, "sandbox_not_running"},
		{"tampered signature", urlA, authHeader(tampered), proto, 401, "token_bad_signature"},
		{"garbage token", urlA, authHeader("not-a-token"), proto, 401, "token_malformed"},
		{"revoked-looking API key", urlA, authHeader("sbk_aaaaaaaaaaaaaaaa_" + strings.Repeat("b", 43)), proto, 401, "unauthenticated"},
	}
	for _, tc := range cases {
		status, eb := dialStatus(t, tc.url, tc.hdr, tc.protos)
		if status != tc.status || eb.Error.Code != tc.code {
			t.Errorf("%s: got %d %+v, want %d %s", tc.name, status, eb, tc.status, tc.code)
		}
		raw, _ := json.Marshal(eb)
		for _, secret := range []string{mA.Token, tampered, other.APIKey(), b.Client.APIKey()} {
			if bytes.Contains(raw, []byte(secret)) {
				t.Errorf("%s: the answer echoes a credential", tc.name)
			}
		}
	}
	// A stopped sandbox: the owner is told how to resume it, a delegate that its owner must.
	if _, eb := dialStatus(t, dataplaneURL(b, "sbx-stopped"), authHeader(b.Client.APIKey()), proto); !strings.Contains(eb.Error.Message, "sbctl resume sbx-stopped") {
		t.Errorf("stopped sandbox, owner: %q does not say how to resume it", eb.Error.Message)
	}
	if _, eb := dialStatus(t, mStopped.Sandbox.DataplaneURL, authHeader(mStopped.Token), proto); !strings.Contains(eb.Error.Message, "its owner must resume it") {
		t.Errorf("stopped sandbox, token: %q", eb.Error.Message)
	}
	// Another org's API key learns the same as for a sandbox that does not exist.
	_, missing := dialStatus(t, dataplaneURL(b, "sb_00000000-0000-4000-8000-000000000000"), authHeader(other.APIKey()), proto)
	if missing.Error.Code != "not_found" {
		t.Errorf("missing sandbox: %+v", missing)
	}

	// The browser form: the credential rides in a second subprotocol, the server selects only
	// the dataplane subprotocol and never echoes the bearer one.
	d := websocket.Dialer{Subprotocols: []string{protocol.Subprotocol, protocol.BearerSubprotocolPrefix + mA.Token}}
	ws, resp, err := d.DialContext(ctx, urlA, nil)
	if err != nil {
		t.Fatalf("browser form: %v %v", err, resp)
	}
	defer ws.Close()
	if ws.Subprotocol() != protocol.Subprotocol || resp.Header.Values("Sec-WebSocket-Protocol")[0] != protocol.Subprotocol {
		t.Errorf("selected subprotocol %q / %q", ws.Subprotocol(), resp.Header.Values("Sec-WebSocket-Protocol"))
	}
	for k, vs := range resp.Header {
		for _, v := range vs {
			if strings.Contains(v, mA.Token) {
				t.Errorf("the upgrade answer echoes the token in %s", k)
			}
		}
	}
	bc := &rawConn{t: t, ws: ws}
	bc.readHello()
	if bc.hello.SandboxID != a.Sandbox.ID {
		t.Errorf("hello: %+v", bc.hello)
	}
	bc.ping()
	assertAlive(t, b, urlA, mA.Token)
}

// A broker shutdown closes every connection with 1001, when its timeout passes, and waits for them:
// their last events must not race the event writer's close (a send on a closed channel would crash
// the broker).
func TestDataplaneShutdownClosesConnections(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "shutdown")
	m, err := b.Client.Delegate(t.Context(), "shutdown", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	if err != nil {
		t.Fatal(err)
	}
	var watches []<-chan closeInfo
	for i, cred := range []string{b.Client.APIKey(), m.Token, m.Token} {
		c := dialRaw(t, url, cred)
		// Requests in flight: an exec, an upload that never ends, and writes.
		c.sendJSON(protocol.Request{ID: 1, Op: "exec", Args: map[string]any{"command": "sleep 30"}})
		c.sendJSON(protocol.Request{ID: 2, Op: "upload", Args: map[string]any{"path": fmt.Sprintf("up-%d.txt", i)}})
		c.sendBinary(dataFrame(protocol.FrameData, 2, []byte("partial")))
		for j := 0; j < 20; j++ {
			c.sendJSON(protocol.Request{ID: uint32(10 + j), Op: "write", Args: map[string]any{"path": fmt.Sprintf("w-%d-%d.txt", i, j), "content": "x"}})
		}
		c.ping()
		watches = append(watches, closeWatch(c))
	}
	// And one that never reads, so never answers the close: its reader ends only at its deadline,
	// after the broker's own shutdown steps.
	mute := dialRaw(t, url, m.Token)
	mute.sendJSON(protocol.Request{ID: 1, Op: "exec", Args: map[string]any{"command": "sleep 30"}})
	// The requests in flight outlast the shutdown timeout: they are cut when it passes.
	start := time.Now()
	b.StopWithin(2 * time.Second)
	if took := time.Since(start); took > 8*time.Second {
		t.Errorf("shutdown took %s", took)
	}
	for i, w := range watches {
		select {
		case got := <-w:
			if got.code != websocket.CloseGoingAway || got.reason != "broker shutting down" {
				t.Errorf("connection %d: closed by %d %q (%v), want 1001", i, got.code, got.reason, got.err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("connection %d still open after shutdown", i)
		}
	}
	entries, _ := os.ReadDir(workspaceDir(b, m.Sandbox.SandboxID))
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "up-") || strings.Contains(e.Name(), "tmp") {
			t.Errorf("an upload cut by the shutdown left %s", e.Name())
		}
	}
}

// Two brokers on one Redis: a sandbox's dataplane is only on its own broker (409 wrong_node
// elsewhere), and a revocation made through the other broker closes its connections within a
// second.
func TestDataplaneTwoBrokers(t *testing.T) {
	t.Parallel()
	b1 := servertest.New(t, servertest.Options{Provider: "dir"})
	b2 := servertest.New(t, servertest.Options{Provider: "dir", Redis: b1.Redis, Node: "node-2"})
	id, url := newSandbox(t, b1, "two")
	m, err := b1.Client.Delegate(t.Context(), "two", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	// (Only with the owner's key: each servertest broker has a signing keyring of its own, so the
	// other broker does not know the token's key.)
	status, eb := dialStatus(t, dataplaneURL(b2, id), authHeader(b2.Client.APIKey()), []string{protocol.Subprotocol})
	if status != 409 || eb.Error.Code != protocol.CodeWrongNode {
		t.Errorf("dataplane on the other broker: %d %+v, want 409 wrong_node", status, eb)
	}
	c := dialRaw(t, url, m.Token)
	c.ping()
	closed := closeWatch(c)
	start := time.Now()
	if _, err := b2.Client.Revoke(t.Context(), id, m.JTI); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-closed:
		if took := got.at.Sub(start); took > time.Second {
			t.Errorf("closed %s after a revocation through the other broker", took)
		}
		if got.code != protocol.CloseCredentialEnded || got.reason != protocol.CodeTokenRevoked {
			t.Errorf("close %d %q (%v)", got.code, got.reason, got.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("still open 5s after a revocation through the other broker")
	}
	assertAlive(t, b1, url, b1.Client.APIKey())
}

// A token with fs:write is refused an allowlist entry that reaches the workspace through /proc (the
// exec's cwd, /workspace by default, or the sandbox's root), as one under /workspace is: the token
// could rewrite that program, so the allowlist would allow any. In a real sandbox, such an entry
// ran the program the token had just written.
func TestAllowlistEntryThroughProcReachesTheWorkspace(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	ctx := t.Context()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "proc"})
	if err != nil {
		t.Fatal(err)
	}
	ws := workspaceDir(b, res.Sandbox.ID)
	for i, entry := range []string{"/proc/self/cwd/run.sh", "/proc/self/root/workspace/run.sh", "/proc/thread-self/cwd/run.sh", "/proc/1/cwd/run.sh"} {
		m, err := b.Client.Delegate(ctx, "proc", protocol.MintRequest{Scopes: []string{"exec", "fs:write"}, AllowCmd: []string{entry}})
		var pe *protocol.Error
		if errors.As(err, &pe) && pe.Code == protocol.CodeInvalidArgument {
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", entry, err)
		}
		// Minted: show what the token can do with it.
		c := dialRaw(t, m.Sandbox.DataplaneURL, m.Token)
		marker := fmt.Sprintf("pwned-%d", i)
		script := "#!/bin/sh\ntouch /workspace/" + marker + "\n"
		if got := c.call(1, "write", map[string]any{"path": "run.sh", "content": script}); got.Error != nil {
			t.Fatalf("write: %s", got)
		}
		os.Chmod(filepath.Join(ws, "run.sh"), 0o755) // as the sandbox itself could
		got := c.call(2, "exec", map[string]any{"argv": []string{entry}})
		_, serr := os.Stat(filepath.Join(ws, marker))
		t.Errorf("%s with fs:write was minted, and ran the program the token wrote: %v (exec %s)", entry, serr == nil, got)
	}
}

// A template whose PATH names a directory the token may write (here the workspace's own bin) lets
// a token with fs:write and a bare allowlisted name plant any program under that name: the
// exec finds the planted one first. Such a mint is refused, saying which PATH entry; without
// fs:write, or with the program named by an absolute path, it is minted.
func TestAllowlistNameFoundThroughAWritablePATHIsRefused(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace", Templates: map[string]provider.Template{
		"default": {Name: "default"},
		"venv":    {Name: "venv", Env: map[string]string{"PATH": "/workspace/.venv/bin:/usr/bin:/bin"}},
	}})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "venv", Template: "venv"}); err != nil {
		t.Fatal(err)
	}
	_, err := b.Client.Delegate(ctx, "venv", protocol.MintRequest{Scopes: []string{"exec", "fs:write"}, AllowCmd: []string{"pytest"}})
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeInvalidArgument || !strings.Contains(pe.Message, "/workspace/.venv/bin") {
		t.Fatalf("fs:write with pytest found through /workspace/.venv/bin: %v, want invalid_argument naming the PATH entry", err)
	}
	for _, req := range []protocol.MintRequest{
		{Scopes: []string{"exec", "fs:read"}, AllowCmd: []string{"pytest"}},
		{Scopes: []string{"exec", "fs:write"}, AllowCmd: []string{"/usr/bin/true"}},
	} {
		if _, err := b.Client.Delegate(ctx, "venv", req); err != nil {
			t.Errorf("%v %v: %v, want it minted", req.Scopes, req.AllowCmd, err)
		}
	}
	// The default template's PATH is the image's own directories: a bare name is fine there.
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "plain"}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.Delegate(ctx, "plain", protocol.MintRequest{Scopes: []string{"exec", "fs:write"}, AllowCmd: []string{"pytest"}}); err != nil {
		t.Errorf("a bare name under the default PATH: %v", err)
	}
}

// remoteDir is the dir provider dressed as a remote one (as the kubernetes provider is): what the
// mint looks at is only that the sandbox's PATH is then its image's, which the broker does not know.
type remoteDir struct{ provider.Provider }

func (remoteDir) RemoteWorkspace() {}

// On the kubernetes provider a template that sets no PATH runs its image's, which only the running
// pod tells (its environment snapshot) and which may name a directory under /workspace (a venv's
// bin): a running sandbox's mint is checked against the PATH it has; once it is not running here,
// a mint with fs:write and a bare allowlisted name is refused, saying why and what to do, not
// checked against a PATH the sandbox may not have. A template that sets PATH, a program named by
// its absolute path, or a token without fs:write is minted.
func TestAllowlistNameUnderAnUnknownPATHIsRefused(t *testing.T) {
	t.Parallel()
	dataDir := servertest.DataDir(t)
	dir, _, err := provider.Preflight(t.Context(), provider.Config{DataDir: dataDir}, "dir")
	if err != nil {
		t.Fatal(err)
	}
	b := servertest.New(t, servertest.Options{ProviderImpl: remoteDir{dir}, DataDir: dataDir, Templates: map[string]provider.Template{
		"default": {Name: "default"},
		"pinned":  {Name: "pinned", Env: map[string]string{"PATH": "/usr/bin:/bin"}},
	}})
	ctx := t.Context()
	for _, name := range []string{"image", "pinned"} {
		req := protocol.CreateSandboxRequest{Name: name}
		if name == "pinned" {
			req.Template = "pinned"
		}
		if _, err := b.Client.CreateSandbox(ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.Client.Delegate(ctx, "image", protocol.MintRequest{Scopes: []string{"exec", "fs:write"}, AllowCmd: []string{"pytest"}}); err != nil {
		t.Fatalf("fs:write with pytest in a running sandbox whose PATH is the base one: %v, want it minted", err)
	}
	if _, err := b.Client.StopSandbox(ctx, "image"); err != nil {
		t.Fatal(err)
	}
	_, err = b.Client.Delegate(ctx, "image", protocol.MintRequest{Scopes: []string{"exec", "fs:write"}, AllowCmd: []string{"pytest"}})
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeInvalidArgument || !strings.Contains(pe.Message, "does not know") {
		t.Fatalf("fs:write with pytest under the image's PATH: %v, want invalid_argument saying the PATH is unknown", err)
	}
	for _, mint := range []struct {
		sandbox string
		req     protocol.MintRequest
	}{
		{"image", protocol.MintRequest{Scopes: []string{"exec", "fs:read"}, AllowCmd: []string{"pytest"}}},
		{"image", protocol.MintRequest{Scopes: []string{"exec", "fs:write"}, AllowCmd: []string{"/usr/bin/true"}}},
		{"pinned", protocol.MintRequest{Scopes: []string{"exec", "fs:write"}, AllowCmd: []string{"pytest"}}},
	} {
		if _, err := b.Client.Delegate(ctx, mint.sandbox, mint.req); err != nil {
			t.Errorf("%s %v %v: %v, want it minted", mint.sandbox, mint.req.Scopes, mint.req.AllowCmd, err)
		}
	}
}
