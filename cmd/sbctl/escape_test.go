package main

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

func TestMain(m *testing.M) { servertest.Main(m) }

// hostile is what a delegate can put in a path or a command: a window title and a clipboard write
// (OSC 0 and 52), a carriage return and a newline that forge a line of their own, an 8-bit CSI,
// and a right-to-left override that reverses what follows.
const hostile = "\x1b]0;pwned\x07\x1b]52;c;cHduZWQ=\x07\r\n12:00:00\texec\tpytest  -> exit 0\u009b2J\u202etxt.exe"

// sbctlAt runs the CLI in-process as b's owner.
func sbctlAt(t *testing.T, b *servertest.Broker, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	args = append([]string{"--broker", b.URL, "--api-key", b.Client.APIKey(), "--config", filepath.Join(t.TempDir(), "none.yaml")}, args...)
	code = run(t.Context(), args, strings.NewReader(""), &out, &errb)
	return code, out.String(), errb.String()
}

// unsafeRune reports the first rune of s that a terminal would act on rather than show.
func unsafeRune(s string, allowed string) (rune, bool) {
	for _, r := range s {
		if strings.ContainsRune(allowed, r) {
			continue
		}
		if unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) || r == '\u2028' || r == '\u2029' || r == utf8RuneError {
			return r, true
		}
	}
	return 0, false
}

const utf8RuneError = '\uFFFD'

// A delegate's paths and commands reach the owner's terminal through sbctl events; every human
// output escapes what a terminal would act on, so nothing can forge a line, set a window title or
// write the clipboard. JSON output stays exact.
func TestHumanOutputEscapesControls(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(ctx, "dev", protocol.MintRequest{Scopes: []string{"fs:write", "exec"}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Sandbox.Credential})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	path := "/workspace/a" + strings.ReplaceAll(hostile, "/", "")
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: path, Content: "x"}); err != nil {
		t.Fatal(err)
	}
	command := "true '" + hostile + "'"
	if _, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: command}}); err != nil {
		t.Fatal(err)
	}
	// The events are written asynchronously: wait for both, as JSON, which must carry them exactly.
	var evs []protocol.Event
	for deadline := time.Now().Add(10 * time.Second); ; {
		code, out, stderr := sbctlAt(t, b, "events", "dev", "-o", "json")
		if code != 0 {
			t.Fatalf("events -o json: exit %d %s", code, stderr)
		}
		evs = evs[:0]
		dec := json.NewDecoder(strings.NewReader(out))
		var gotPath, gotCmd bool
		for dec.More() {
			var e protocol.Event
			if err := dec.Decode(&e); err != nil {
				t.Fatal(err)
			}
			evs = append(evs, e)
			gotPath = gotPath || e.Path == path
			gotCmd = gotCmd || e.Command == command
		}
		if gotPath && gotCmd {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the events never carried the exact path and command:\n%s", out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, args := range [][]string{{"events", "dev"}, {"events", "--all"}} {
		code, out, stderr := sbctlAt(t, b, args...)
		if code != 0 {
			t.Fatalf("%v: exit %d %s", args, code, stderr)
		}
		if r, bad := unsafeRune(out, "\n\t"); bad {
			t.Errorf("%v prints %U raw:\n%q", args, r, out)
		}
		if lines := strings.Count(out, "\n"); lines != len(evs) {
			t.Errorf("%v: %d lines for %d events: a field forged a line:\n%s", args, lines, len(evs), out)
		}
		if !strings.Contains(out, `\x1b]0;pwned\x07`) || !strings.Contains(out, `\u202e`) {
			t.Errorf("%v: the escaped controls are not shown visibly:\n%s", args, out)
		}
	}
	// Errors quote what they name the same way.
	code, _, stderr := sbctlAt(t, b, "get", "nope"+hostile)
	if code == 0 {
		t.Fatal("get of a missing sandbox succeeded")
	}
	if r, bad := unsafeRune(stderr, "\n"); bad || strings.Count(stderr, "\n") != 1 {
		t.Errorf("the error prints %U raw, or takes more than a line: %q", r, stderr)
	}
	for _, c := range []struct {
		in, want string
	}{
		{"plain/path.txt", "plain/path.txt"},
		{"tab\there", `tab\there`},
		{"esc\x1b[31mred", `esc\x1b[31mred`},
		{"cr\rnl\n", `cr\rnl\n`},
		{"c1\u009b2J", `c1\u009b2J`},
		{"bidi\u202e\u2066", `bidi\u202e\u2066`},
		{"line\u2028sep", `line\u2028sep`},
		{"bad\xffutf8", `bad\xffutf8`},
		{"del\x7f", `del\x7f`},
		{"ünïcode ok", "ünïcode ok"},
	} {
		if got := termSafe(c.in); got != c.want {
			t.Errorf("termSafe(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}
