package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
)

// sbctl runs the CLI in-process against broker (a URL) with no config file.
func sbctl(t *testing.T, ctx context.Context, broker string, stdin string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	args = append([]string{"--broker", broker, "--api-key", "sbk_test", "--config", filepath.Join(t.TempDir(), "none.yaml")}, args...)
	code = run(ctx, args, strings.NewReader(stdin), &out, &errb)
	return code, out.String(), errb.String()
}

// Mistakes cobra itself catches exit 2 (usage) like ours, with a message that says what to do;
// none of them reaches the broker.
func TestUsageErrorsExit2(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"foo"}, `unknown command "foo"`},
		{[]string{"lsit"}, "did you mean list?"},
		{[]string{"help", "creat"}, `unknown help topic "creat" (did you mean create?); see sbctl --help`},
		{[]string{"help", "mcp", "confg"}, `unknown help topic "mcp confg"`},
		{[]string{"help", "nope"}, `unknown help topic "nope"; see sbctl --help`},
		{[]string{"mcp", "config"}, "see sbctl mcp config --help"},
		{[]string{"completion", "nope"}, `unknown command "nope" for "sbctl completion"; see sbctl completion --help`},
		{[]string{"completion", "bash", "x"}, "see sbctl completion bash --help"},
		{[]string{"mcp", "config", "dev"}, `--client must be claude-code, cursor or vscode, not ""; see sbctl mcp config --help`},
		{[]string{"introspect"}, "no token given: pass it as TOKEN, or pipe it in"},
		{[]string{"version"}, `unknown command "version" (did you mean --version?)`},
		{[]string{"delete"}, "give a REF, or at least one --tag k=v (not both); see sbctl delete --help"},
		{[]string{"events"}, "give a REF, or --all for the whole org (not both); see sbctl events --help"},
		{[]string{"create", "a", "b"}, "at most one NAME"},
		{[]string{"list", "x"}, "no arguments"},
		{[]string{"sweep", "--dry-run", "x"}, "no arguments"},
		{[]string{"introspect", "a", "b"}, "at most one TOKEN"},
		{[]string{"run-config", "a", "b"}, "one REF"},
		{[]string{"delegate", "dev"}, "--scope is required"},
		{[]string{"get", "dev", "--bogus"}, "unknown flag"},
		{[]string{"create", "dev", "--ttll", "5m"}, "unknown flag: --ttll (did you mean --ttl?); see sbctl create --help"},
		{[]string{"exec", "dev", "--cdw", "/tmp", "--", "true"}, "did you mean --cwd?"},
		{[]string{"create", "dev", "--ttl"}, "see sbctl create --help"},
		{[]string{"events", "dev", "--since", "bogus"}, `--since "bogus" is not an event id`},
		{[]string{"events", "dev", "-o", "yaml"}, "does not print -o yaml"},
		{[]string{"exec", "dev", "-o", "json", "--", "true"}, "does not print -o json"},
		{[]string{"run-config", "dev", "-o", "yaml"}, "--format"},
		{[]string{"attach", "dev", "-o", "yaml"}, "does not print -o yaml"},
		{[]string{"create", "x", "--ttl", "500ms"}, "less than a second"},
		{[]string{"create", "x", "--ttl", "-5m"}, "less than a second"},
		{[]string{"extend", "x", "--ttl", "0.5s"}, "less than a second"},
		{[]string{"delegate", "x", "--scope", "exec", "--expires", "100ms"}, "less than a second"},
		// An empty allowlist would be dropped from the request and allow every program.
		{[]string{"delegate", "x", "--scope", "exec", "--allow-cmd", ""}, "--allow-cmd names no program"},
		{[]string{"run-config", "x", "--allow-cmd", ""}, "--allow-cmd names no program"},
		{[]string{"mcp", "x", "--allow-cmd", ""}, "--allow-cmd names no program"},
		{[]string{"mcp", "config", "x", "--client", "claude-code", "--allow-cmd", ""}, "--allow-cmd names no program"},
		{[]string{"run-config", "--thread", "t", "--ttl", "1ms"}, "less than a second"},
		{[]string{"exec", "x", "--timeout", "1us", "--", "true"}, "at least 1ms"},
		{[]string{"exec", "dev"}, "no command: give one after --"},
		{[]string{"exec", "dev", "-c", "true", "--", "true"}, "not both"},
		{[]string{"create", "x", "--ttl", "1fortnight"}, "7d"},
		{[]string{"shell"}, "shell takes REF"},
		{[]string{"shell", "dev", "python3"}, "give a program after --"},
		{[]string{"shell", "dev", "-o", "json"}, "does not print -o json"},
		{[]string{"shell", "dev", "--env", "NOEQUALS"}, "is not NAME=value"},
		{[]string{"shell", "dev"}, "needs a terminal"},
	} {
		code, _, stderr := sbctl(t, t.Context(), "http://127.0.0.1:1", "", tc.args...)
		if code != exitUsage || !strings.Contains(stderr, tc.want) {
			t.Errorf("sbctl %v: exit %d %q; want exit 2 mentioning %q", tc.args, code, stderr, tc.want)
		}
	}
}

// With no API key anywhere, sbctl says where it looked and what to do, once, and exits 4 without
// calling the broker; a --config that names no file is named as such, since the broker writes its
// config to the default path, not to the one given.
func TestNoAPIKeySaysWhatToDo(t *testing.T) {
	t.Setenv("SBX_API_KEY", "")
	t.Setenv("SBCTL_CONFIG", "")
	for _, tc := range []struct {
		config string
		want   string
	}{
		{"", "no API key: pass --api-key, set SBX_API_KEY, or start a broker on its embedded defaults once to write " + client.ConfigPath()},
		{filepath.Join(t.TempDir(), "typo.yaml"), "typo.yaml (--config) does not exist"},
	} {
		var out, errb bytes.Buffer
		args := []string{"--broker", "http://127.0.0.1:1", "list"}
		if tc.config != "" {
			args = append(args, "--config", tc.config)
		}
		code := run(t.Context(), args, strings.NewReader(""), &out, &errb)
		if code != exitAuth || !strings.Contains(errb.String(), tc.want) || strings.Count(errb.String(), "SBX_API_KEY") != 1 {
			t.Errorf("--config %q: exit %d %q; want exit 4 saying %q (SBX_API_KEY named once)", tc.config, code, errb.String(), tc.want)
		}
	}
}

// A --broker with a path, or naming some other server that speaks the API's errors, gets the
// broker's route_not_found: sbctl says to check the URL it was given.
func TestRouteNotFoundNamesTheBrokerURL(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		json.NewEncoder(w).Encode(protocol.ErrorBody{Error: protocol.Error{Code: protocol.CodeRouteNotFound, Message: "no such route: see docs/openapi.yaml for the API"}})
	}))
	defer srv.Close()
	code, _, stderr := sbctl(t, t.Context(), srv.URL+"/api", "", "list")
	if code != exitError || !strings.Contains(stderr, "check --broker "+srv.URL+"/api") {
		t.Fatalf("exit %d %q; want 1 naming the --broker to check", code, stderr)
	}
	withPassword := strings.Replace(srv.URL, "http://", "http://u:hunter2@", 1)
	if _, _, stderr := sbctl(t, t.Context(), withPassword, "", "list"); strings.Contains(stderr, "hunter2") {
		t.Fatalf("the URL's password is in the message: %q", stderr)
	}
}

// sbctl events REF -f ends after the sandbox's deleted event: nothing can follow it, and a pane
// left waiting forever looks like a live sandbox.
func TestEventsFollowEndsAtDelete(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i, typ := range []string{protocol.EventExec, protocol.EventDeleted} {
			b, _ := json.Marshal(protocol.Event{ID: fmt.Sprintf("1-%d", i), Type: typ, SandboxID: "sb_1", Name: "dev", Time: time.Now()})
			fmt.Fprintf(w, "event: %s\nid: 1-%d\ndata: %s\n\n", protocol.SSEEventName, i, b)
		}
		w.(http.Flusher).Flush()
		<-r.Context().Done() // the broker keeps a stream open
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second) // a bound on failure, not a wait
	defer cancel()
	code, stdout, stderr := sbctl(t, ctx, srv.URL, "", "events", "dev", "-f")
	if ctx.Err() != nil || code != 0 || !strings.Contains(stdout, "deleted") || !strings.Contains(stderr, "was deleted") {
		t.Fatalf("exit %d (context %v)\nstdout %q\nstderr %q; want exit 0 after the deleted event, saying so", code, ctx.Err(), stdout, stderr)
	}
}

// An exec the broker ended says why in the events pane (timeout, memory_limit), as a shell's end
// does: "exit 137" alone reads as the command's own failure.
func TestEventLineSaysWhyAnExecEnded(t *testing.T) {
	code, ms := 137, int64(1002)
	line := eventLine(protocol.Event{Type: protocol.EventExec, Command: "sleep 5", ExitCode: &code, DurationMS: &ms, Reason: "timeout"}, false)
	if !strings.HasSuffix(line, "sleep 5  -> exit 137 (1002ms)  timeout") {
		t.Fatalf("%q", line)
	}
}

// Days are accepted wherever a duration is, as the broker accepts them.
func TestDurationsTakeDays(t *testing.T) {
	t.Parallel()
	var got protocol.CreateSandboxRequest
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		json.NewDecoder(r.Body).Decode(&got)
		json.NewEncoder(w).Encode(protocol.CreateSandboxResponse{Outcome: "created", Sandbox: protocol.Sandbox{ID: "sb_1", Name: got.Name}})
	}))
	defer srv.Close()
	if code, _, stderr := sbctl(t, t.Context(), srv.URL, "", "create", "x", "--ttl", "1d12h", "-q"); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if got.TTLSeconds == nil || *got.TTLSeconds != 36*3600 {
		t.Fatalf("ttl_seconds: %v", got.TTLSeconds)
	}
}

func TestExitCodes(t *testing.T) {
	t.Parallel()
	for code, want := range map[string]int{
		protocol.CodeUnreachable: exitUnreachable, protocol.CodeUnavailable: exitUnreachable,
		protocol.CodeWrongNode: exitConflict, protocol.CodeNotRunning: exitConflict, protocol.CodeNotFound: exitNotFound,
	} {
		if got := exitCodeOf(protocol.Errorf(code, "x")); got != want {
			t.Errorf("%s: exit %d, want %d", code, got, want)
		}
	}
	if got := exitCodeOf(&client.UnreachableError{URL: "http://x", Err: os.ErrDeadlineExceeded}); got != exitUnreachable {
		t.Errorf("unreachable broker: %d", got)
	}
}

// Ctrl-C (or SIGTERM) ends a command quietly with 128+signal, not "context canceled" and 1.
func TestInterruptedExitsQuietly(t *testing.T) {
	t.Parallel()
	for sig, want := range map[syscall.Signal]int{syscall.SIGINT: 130, syscall.SIGTERM: 143} {
		ctx, cancel := context.WithCancelCause(t.Context())
		cancel(interrupted{sig})
		code, _, stderr := sbctl(t, ctx, "http://127.0.0.1:1", "", "list")
		if code != want || stderr != "" {
			t.Errorf("%v: exit %d %q; want %d and nothing on stderr", sig, code, stderr, want)
		}
	}
}

// /dev/null is a character device but not a terminal: a delete --tag from a script must not prompt.
func TestDevNullIsNotATerminal(t *testing.T) {
	t.Parallel()
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if isTerminal(f) {
		t.Fatal("/dev/null counted as a terminal")
	}
}

// exec -i refuses input it would have to cut or alter.
func TestReadStdin(t *testing.T) {
	t.Parallel()
	if s, err := readStdin(strings.NewReader("print(2+2)\n"), 1<<20); err != nil || s != "print(2+2)\n" {
		t.Fatalf("small text: %q %v", s, err)
	}
	if _, err := readStdin(bytes.NewReader(make([]byte, 2<<20)), 1<<20); exitCodeOf(err) != exitUsage || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("too large: %v", err)
	}
	if _, err := readStdin(bytes.NewReader([]byte{0xff, 0xfe, 'x'}), 1<<20); exitCodeOf(err) != exitUsage || !strings.Contains(err.Error(), "UTF-8") {
		t.Fatalf("binary: %v", err)
	}
}

// attach --stop-on-exit says "stopped" only for sandboxes it stopped; a failed stop is reported
// with its own exit code.
func TestAttachStopOnExitReportsFailures(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancelCause(t.Context())
	defer cancel(nil)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/heartbeats":
			exp := time.Now().Add(time.Hour)
			json.NewEncoder(w).Encode(protocol.HeartbeatsResponse{Items: []protocol.HeartbeatItem{
				{Ref: "a", Lease: &protocol.HeartbeatResponse{Status: "running", TTLSeconds: 3600, ExpiresAt: &exp}},
				{Ref: "b", Lease: &protocol.HeartbeatResponse{Status: "running", TTLSeconds: 3600, ExpiresAt: &exp}},
			}})
			cancel(interrupted{syscall.SIGINT}) // Ctrl-C after the first beat
		case "/v1/sandboxes/a/stop":
			json.NewEncoder(w).Encode(protocol.Sandbox{ID: "sb_a", Name: "a", Status: "stopped"})
		default:
			w.WriteHeader(http.StatusNotFound)
			json.NewEncoder(w).Encode(protocol.ErrorBody{Error: protocol.Error{Code: protocol.CodeNotFound, Message: "no sandbox b"}})
		}
	}))
	defer srv.Close()
	code, _, stderr := sbctl(t, ctx, srv.URL, "", "attach", "a", "b", "--stop-on-exit")
	if code != exitNotFound || !strings.Contains(stderr, "stopped a\n") || strings.Contains(stderr, "stopped b") ||
		!strings.Contains(stderr, "b was not stopped: no sandbox b") {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr)
	}
}

// -q prints only ids on get and delegations too, as on list.
func TestQuietPrintsIDs(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/delegations") {
			json.NewEncoder(w).Encode(protocol.ListDelegationsResponse{Items: []protocol.Delegation{{JTI: "j1"}, {JTI: "j2"}}})
			return
		}
		json.NewEncoder(w).Encode(protocol.Sandbox{ID: "sb_1", Name: "dev"})
	}))
	defer srv.Close()
	for args, want := range map[string]string{"get dev -q": "sb_1\n", "delegations dev -q": "j1\nj2\n"} {
		if code, out, stderr := sbctl(t, t.Context(), srv.URL, "", strings.Fields(args)...); code != 0 || out != want {
			t.Errorf("sbctl %s: exit %d %q %q", args, code, out, stderr)
		}
	}
}

// A sandbox that is not isolated is announced on stderr, whatever the output format; an isolated
// one is not.
func TestCreateWarnsWhenNotIsolated(t *testing.T) {
	t.Parallel()
	for isolation, warn := range map[string]bool{protocol.IsolationNone: true, protocol.IsolationNamespace: false} {
		sb := protocol.Sandbox{ID: "sb_1", Name: "dev", Status: "running", Isolation: isolation}
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost {
				json.NewEncoder(w).Encode(protocol.CreateSandboxResponse{Outcome: "created", Sandbox: sb})
				return
			}
			json.NewEncoder(w).Encode(sb)
		}))
		for _, args := range [][]string{{"create", "dev"}, {"create", "dev", "-o", "json"}, {"create", "dev", "-q"}} {
			code, out, stderr := sbctl(t, t.Context(), srv.URL, "", args...)
			if code != 0 || strings.Contains(out, "not isolated") || strings.Contains(stderr, "warning: sandbox dev is not isolated") != warn {
				t.Errorf("%s, sbctl %v: exit %d\nstdout: %s\nstderr: %s", isolation, args, code, out, stderr)
			}
		}
		// get shows it in its table too.
		if code, out, stderr := sbctl(t, t.Context(), srv.URL, "", "get", "dev"); code != 0 || !strings.Contains(out, "Isolation:       "+isolation) {
			t.Errorf("%s, sbctl get: exit %d\nstdout: %s\nstderr: %s", isolation, code, out, stderr)
		}
		srv.Close()
	}
}

// A sandbox whose broker was declared lost says so in get's table, not only in JSON.
func TestGetSaysBrokerLost(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	sb := protocol.Sandbox{ID: "sb_1", Name: "dev", Status: "running", NodeStatus: protocol.NodeLost, NodeLostAt: &at}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { json.NewEncoder(w).Encode(sb) }))
	defer srv.Close()
	code, out, stderr := sbctl(t, t.Context(), srv.URL, "", "get", "dev")
	if code != 0 || !strings.Contains(out, "running, broker lost") || !strings.Contains(out, "Broker lost:     2026-01-02T03:04:05Z") {
		t.Errorf("sbctl get: exit %d\nstdout: %s\nstderr: %s", code, out, stderr)
	}
}

// A sandbox running as a pod says where in get's table: the cluster node and the pod.
func TestGetShowsPlacement(t *testing.T) {
	t.Parallel()
	sb := protocol.Sandbox{ID: "sb_1", Name: "dev", Status: "running", Provider: "kubernetes", Isolation: "container",
		Placement: &protocol.Placement{Node: "node-a", Pod: "sbx/sbx-1"}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { json.NewEncoder(w).Encode(sb) }))
	defer srv.Close()
	code, out, stderr := sbctl(t, t.Context(), srv.URL, "", "get", "dev")
	if code != 0 || !strings.Contains(out, "Placement:       node node-a, pod sbx/sbx-1") {
		t.Errorf("sbctl get: exit %d\nstdout: %s\nstderr: %s", code, out, stderr)
	}
}

// Every refusal of a credential exits 4 as the help says, whichever way it is refused: a bad,
// expired or revoked token, a scope or command the token does not allow.
func TestCredentialRefusalsExit4(t *testing.T) {
	t.Parallel()
	for _, code := range []string{
		protocol.CodeUnauthenticated, protocol.CodeForbidden, protocol.CodeDelegateForbidden,
		protocol.CodeTokenMalformed, protocol.CodeTokenExpired, protocol.CodeTokenRevoked, protocol.CodeTokenSignature,
		protocol.CodeTokenSandbox, protocol.CodeTokenAudience, protocol.CodeScopeDenied, protocol.CodeCommandNotAllowed,
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			json.NewEncoder(w).Encode(protocol.ErrorBody{Error: protocol.Error{Code: code, Message: "refused"}})
		}))
		exit, _, stderr := sbctl(t, t.Context(), srv.URL, "", "get", "dev")
		srv.Close()
		if exit != exitAuth {
			t.Errorf("%s: exit %d (%s); want %d", code, exit, stderr, exitAuth)
		}
	}
}

// Shell completion offers the org's sandbox names for a REF and its tags for --tag, from the
// broker, and never a name a shell or terminal would misread.
func TestCompletion(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/sandboxes" {
			http.NotFound(w, r)
			return
		}
		json.NewEncoder(w).Encode(protocol.ListSandboxesResponse{Items: []protocol.Sandbox{
			{ID: "sb_1", Name: "dev", Tags: map[string]string{"thread_id": "T42", "team": "infra"}},
			{ID: "sb_2", Name: "demo", Tags: map[string]string{"thread_id": "T7"}},
			{ID: "sb_3", Name: "ci", Tags: map[string]string{"evil": "a\x1b]0;x\x07"}},
		}})
	}))
	defer srv.Close()
	complete := func(args ...string) []string {
		t.Helper()
		var out, errb bytes.Buffer
		all := append([]string{"__complete", "--broker", srv.URL, "--api-key", "sbk_test", "--config", filepath.Join(t.TempDir(), "none.yaml")}, args...)
		if code := run(t.Context(), all, strings.NewReader(""), &out, &errb); code != 0 {
			t.Fatalf("sbctl %v: exit %d: %s", all, code, errb.String())
		}
		var got []string
		for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
			if !strings.HasPrefix(l, ":") {
				got = append(got, l)
			}
		}
		return got
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"get", ""}, "ci demo dev"},
		{[]string{"stop", "de"}, "demo dev"},
		{[]string{"get", "dev", ""}, ""}, // one REF only
		{[]string{"heartbeat", "dev", ""}, "ci demo"},
		{[]string{"exec", "d"}, "demo dev"},
		{[]string{"list", "--tag", "thread_id="}, "thread_id=T42 thread_id=T7"},
		{[]string{"delete", "--tag", ""}, "team=infra thread_id=T42 thread_id=T7"},
		{[]string{"list", "--status", "r"}, "running"},
	} {
		if got := strings.Join(complete(tc.args...), " "); got != tc.want {
			t.Errorf("complete %q: %q, want %q", tc.args, got, tc.want)
		}
	}
}
