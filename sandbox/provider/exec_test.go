package provider

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// providers are both runtimes, for tests of behaviour they must share.
func providers(t *testing.T) []Provider {
	return []Provider{newNamespace(t, Config{}), newDir(t)}
}

// wsPath is what pwd prints in the workspace: the dir provider has no /workspace.
func wsPath(p Provider, spec Spec) string {
	if p.Name() == kindDir {
		return p.WorkspaceDir(spec)
	}
	return WorkspacePath
}

// marker is a unique `sleep N` whose processes can be found from the host by their command line.
// Inside, match it with pgrep -f '[s]leep N' so that the pgrep's own shell does not match.
func marker() string { return "sleep " + strconv.Itoa(3000000+rand.IntN(1000000)) }

// hostPids lists host processes (not zombies) whose command line contains s.
func hostPids(s string) []int {
	d, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range d {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || len(b) == 0 {
			continue
		}
		if strings.Contains(string(bytes.ReplaceAll(b, []byte{0}, []byte{' '})), s) {
			out = append(out, pid)
		}
	}
	return out
}

// waitHostGone waits until no host process matches s.
func waitHostGone(t *testing.T, s string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(hostPids(s)) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("processes matching %q still running: %v", s, hostPids(s))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func waitHostRunning(t *testing.T, s string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(hostPids(s)) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no process matching %q", s)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestExecSemantics(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			t.Parallel()
			in, spec := startSandbox(t, p, Template{Env: map[string]string{"TMPL_VAR": "from-template"}})
			ws := wsPath(p, spec)
			if _, out := sh(t, in, "mkdir -p sub/deeper"); out != "" {
				t.Fatal(out)
			}
			tests := []struct {
				name     string
				req      ExecRequest
				stdout   string // combined output unless stderr is set
				stderr   *string
				code     int
				signal   string
				trunc    bool
				contains string
			}{
				{name: "shell string", req: ExecRequest{Command: "echo hello"}, stdout: "hello\n"},
				{name: "argv no shell", req: ExecRequest{Argv: []string{"printf", "%s|", "a b", "$HOME"}}, stdout: "a b|$HOME|"},
				{name: "argv absolute", req: ExecRequest{Argv: []string{"/usr/bin/echo", "x"}}, stdout: "x\n"},
				{name: "argv not found", req: ExecRequest{Argv: []string{"no-such-program-xyz"}}, code: 127, contains: "command not found"},
				{name: "exit code", req: ExecRequest{Command: "exit 3"}, code: 3},
				{name: "signal exit", req: ExecRequest{Command: "kill -TERM $$"}, code: 143, signal: "TERM"},
				{name: "cwd default", req: ExecRequest{Command: "pwd"}, stdout: ws + "\n"},
				{name: "cwd absolute sub", req: ExecRequest{Command: "pwd", Cwd: "/workspace/sub/deeper"}, stdout: ws + "/sub/deeper\n"},
				{name: "cwd relative", req: ExecRequest{Command: "pwd", Cwd: "sub"}, stdout: ws + "/sub\n"},
				{name: "cwd cleaned", req: ExecRequest{Command: "pwd", Cwd: "/workspace/sub/../sub/"}, stdout: ws + "/sub\n"},
				{name: "env override", req: ExecRequest{Command: `echo "$TMPL_VAR $NEW_VAR $LANG"`, Env: map[string]string{"TMPL_VAR": "overridden", "NEW_VAR": "new"}}, stdout: "overridden new C.UTF-8\n"},
				{name: "template env", req: ExecRequest{Command: `echo "$TMPL_VAR"`}, stdout: "from-template\n"},
				{name: "stdin", req: ExecRequest{Command: "cat", Stdin: strings.NewReader("from stdin")}, stdout: "from stdin"},
				{name: "stdin large", req: ExecRequest{Command: "wc -c", Stdin: bytes.NewReader(make([]byte, 3<<20))}, stdout: "3145728\n"},
				{name: "stdin nil is empty", req: ExecRequest{Command: "wc -c"}, stdout: "0\n"},
				{name: "combined keeps order", req: ExecRequest{Command: "echo a; echo b >&2; echo c; echo d >&2"}, stdout: "a\nb\nc\nd\n"},
				{name: "separate streams", req: ExecRequest{Command: "echo out; echo err >&2; echo out2"}, stdout: "out\nout2\n", stderr: ptr("err\n")},
				{name: "output cap", req: ExecRequest{Command: "yes | head -c 100000", MaxOutput: 1000}, stdout: strings.Repeat("y\n", 500), trunc: true},
				{name: "output under cap", req: ExecRequest{Command: "echo hi", MaxOutput: 3}, stdout: "hi\n"},
				{name: "large output", req: ExecRequest{Command: "head -c 5000000 /dev/zero"}, stdout: string(make([]byte, 5000000))},
				// Our ends of the pipes are non-blocking; the command's ends must not be (O_NONBLOCK, 04000).
				{name: "blocking stdio", req: ExecRequest{Command: `for fd in 0 1 2; do printf '%d ' $(( 0$(sed -n 's/^flags:[[:space:]]*//p' /proc/$$/fdinfo/$fd) & 04000 )); done`, Stdin: strings.NewReader("x")}, stdout: "0 0 0 ", stderr: ptr("")},
			}
			for _, tc := range tests {
				t.Run(tc.name, func(t *testing.T) {
					var out, errb bytes.Buffer
					req := tc.req
					req.Stdout = &out
					if tc.stderr != nil {
						req.Stderr = &errb
					}
					res, err := in.Exec(context.Background(), req)
					if err != nil {
						t.Fatal(err)
					}
					if res.ExitCode != tc.code || res.Signal != tc.signal || res.Truncated != tc.trunc || res.Reason != "" {
						t.Errorf("result %+v, want code %d signal %q truncated %v", res, tc.code, tc.signal, tc.trunc)
					}
					if tc.contains != "" {
						if !strings.Contains(out.String(), tc.contains) {
							t.Errorf("output %q does not contain %q", out.String(), tc.contains)
						}
					} else if out.String() != tc.stdout {
						t.Errorf("stdout %q, want %q", trim(out.String()), trim(tc.stdout))
					}
					if tc.stderr != nil && errb.String() != *tc.stderr {
						t.Errorf("stderr %q, want %q", errb.String(), *tc.stderr)
					}
				})
			}

			t.Run("output cap across both streams", func(t *testing.T) {
				// Which pipe is read first is up to the scheduler; the cap is on the sum.
				var out, errb bytes.Buffer
				res, err := in.Exec(context.Background(), ExecRequest{Command: "echo 12345; echo 67890 >&2", MaxOutput: 8, Stdout: &out, Stderr: &errb})
				if err != nil || !res.Truncated || out.Len()+errb.Len() != 8 {
					t.Fatalf("%+v %v: stdout %q stderr %q", res, err, out.String(), errb.String())
				}
			})
			t.Run("stderr only", func(t *testing.T) {
				var errb bytes.Buffer
				res, err := in.Exec(context.Background(), ExecRequest{Command: "echo out; echo err >&2", Stderr: &errb})
				if err != nil || res.ExitCode != 0 || errb.String() != "err\n" {
					t.Fatal(res, err, errb.String())
				}
			})
			t.Run("concurrent execs", func(t *testing.T) {
				const n = 16
				errs := make(chan error, n)
				for i := range n {
					go func() {
						var out bytes.Buffer
						res, err := in.Exec(context.Background(), ExecRequest{Argv: []string{"echo", strconv.Itoa(i)}, Stdout: &out})
						if err == nil && (res.ExitCode != 0 || out.String() != strconv.Itoa(i)+"\n") {
							err = fmt.Errorf("exec %d: %+v %q", i, res, out.String())
						}
						errs <- err
					}()
				}
				for range n {
					if err := <-errs; err != nil {
						t.Error(err)
					}
				}
			})
			t.Run("commands cannot signal the init away", func(t *testing.T) {
				for _, sig := range []string{"TERM", "INT", "HUP", "QUIT", "USR1", "PIPE", "TSTP"} {
					sh(t, in, "kill -"+sig+" $PPID")
				}
				if res, out := sh(t, in, "echo alive"); out != "alive\n" {
					t.Fatalf("after signalling the init: %+v %q", res, out)
				}
				// A caught signal is reset for commands, unlike an ignored one.
				if res, _ := sh(t, in, "kill -TERM $$"); res.Signal != "TERM" {
					t.Errorf("SIGTERM in a command: %+v", res)
				}
			})
			t.Run("stdin that never ends does not hold exec", func(t *testing.T) {
				pr, pw := io.Pipe()
				defer pw.Close()
				start := time.Now()
				res, err := in.Exec(context.Background(), ExecRequest{Command: "echo does not read stdin", Stdin: pr, Stdout: &bytes.Buffer{}})
				if err != nil || res.ExitCode != 0 {
					t.Fatal(res, err)
				}
				if d := time.Since(start); d > 10*time.Second {
					t.Errorf("took %v", d)
				}
			})
			t.Run("streamed stdin", func(t *testing.T) {
				pr, pw := io.Pipe()
				go func() {
					for i := range 3 {
						fmt.Fprintf(pw, "line %d\n", i)
						time.Sleep(10 * time.Millisecond)
					}
					pw.Close()
				}()
				var out bytes.Buffer
				res, err := in.Exec(context.Background(), ExecRequest{Command: "cat", Stdin: pr, Stdout: &out})
				if err != nil || res.ExitCode != 0 || out.String() != "line 0\nline 1\nline 2\n" {
					t.Fatal(res, err, out.String())
				}
			})
			t.Run("nil stdout discards", func(t *testing.T) {
				res, err := in.Exec(context.Background(), ExecRequest{Command: "echo gone; exit 4"})
				if err != nil || res.ExitCode != 4 {
					t.Fatal(res, err)
				}
			})
			t.Run("invalid requests", func(t *testing.T) {
				for _, req := range []ExecRequest{
					{Command: "pwd", Cwd: "/etc"},
					{Command: "pwd", Cwd: "/workspace/../etc"},
					{Command: "pwd", Cwd: "../x"},
					{Command: "pwd", Cwd: "/workspacex"},
					{Command: "pwd", Cwd: "/workspace/does-not-exist"},
					{Command: "true", Env: map[string]string{"BAD-NAME": "x"}},
					{Command: "true", Env: map[string]string{"": "x"}},
					{Command: "true", Argv: []string{"true"}},
					{},
					{Argv: []string{""}},
					{Command: "true", Timeout: -time.Second},
				} {
					res, err := in.Exec(context.Background(), req)
					if !errors.Is(err, ErrInvalidRequest) {
						t.Errorf("%+v: got %+v, %v; want ErrInvalidRequest", req, res, err)
					}
				}
			})
			t.Run("environment", func(t *testing.T) {
				env := in.Environment()
				home := HomePath
				if p.Name() == kindDir {
					home = p.WorkspaceDir(spec)
				}
				if env["PATH"] != basePath || env["HOME"] != home || env["TMPL_VAR"] != "from-template" || env["LANG"] != "C.UTF-8" {
					t.Errorf("environment %v", env)
				}
				// The snapshot is taken from the init's config, not from a command: it must be
				// exactly what a command gets.
				var out bytes.Buffer
				if res, err := in.Exec(context.Background(), ExecRequest{Argv: []string{"env", "-0"}, Stdout: &out}); err != nil || res.ExitCode != 0 {
					t.Fatal(res, err)
				}
				if got := parseEnv0(out.Bytes()); !maps.Equal(got, env) {
					t.Errorf("a command's environment %v, the snapshot %v", got, env)
				}
				// Nothing of the broker's own environment or of the init's invocation leaks in.
				allowed := map[string]bool{"PATH": true, "HOME": true, "USER": true, "LOGNAME": true, "LANG": true, "TERM": true, "SHELL": true, "HOSTNAME": true, "TMPL_VAR": true}
				for k, v := range env {
					if !allowed[k] || strings.Contains(v, InitArg) {
						t.Errorf("unexpected variable %s=%s", k, v)
					}
				}
			})
		})
	}
}

func ptr[T any](v T) *T { return &v }

func trim(s string) string {
	if len(s) > 80 {
		return fmt.Sprintf("%s...(%d bytes)", s[:80], len(s))
	}
	return s
}

// Started comes once, before Exec waits for anything: the dataplane runs an exec on a connection's
// reader until then, and a Started that came only with the command's end would hold that reader
// (pings, cancels) for the command's whole run. Here the command runs until cancelled, which only
// a caller told of its start does.
func TestExecCallsStartedBeforeWaiting(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			t.Parallel()
			in, _ := startSandbox(t, p, Template{})
			for _, tc := range []struct {
				name string
				req  ExecRequest
			}{
				{"foreground", ExecRequest{Command: "sleep 60", Stdout: io.Discard, Stderr: io.Discard}},
				{"stdin", ExecRequest{Command: "cat; sleep 60", Stdin: strings.NewReader("x"), Stdout: io.Discard}},
				{"no output taken", ExecRequest{Argv: []string{"sleep", "60"}}},
				{"background", ExecRequest{Command: "sleep 60", Background: true}},
			} {
				t.Run(tc.name, func(t *testing.T) {
					ctx, cancel := context.WithCancel(t.Context())
					defer cancel()
					started := make(chan struct{})
					req := tc.req
					req.Started = func() { close(started) } // a second call panics
					done := make(chan error, 1)
					go func() {
						_, err := in.Exec(ctx, req)
						done <- err
					}()
					select {
					case <-started:
					case err := <-done:
						t.Fatalf("Exec returned (%v) without calling Started", err)
					}
					cancel()
					<-done
				})
			}
		})
	}
}

func TestExecTimeoutsAndCancel(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			t.Parallel()
			in, _ := startSandbox(t, p, Template{Limits: Limits{ExecTimeout: Duration(300 * time.Millisecond), ExecTimeoutMax: Duration(time.Second)}})

			t.Run("timeout kills the whole tree", func(t *testing.T) {
				m1, m2, m3, m4 := marker(), marker(), marker(), marker()
				// A background child, an orphan (its subshell exits at once), a child that left the
				// process group for its own session, and the main process's own foreground child.
				cmd := fmt.Sprintf("%s & (%s &) ; setsid %s & %s", m1, m2, m3, m4)
				start := time.Now()
				res, err := in.Exec(context.Background(), ExecRequest{Command: cmd, Stdout: &bytes.Buffer{}, Timeout: 400 * time.Millisecond})
				if err != nil {
					t.Fatal(err)
				}
				if res.Reason != ReasonTimeout || res.Signal != "KILL" || res.ExitCode != 137 {
					t.Errorf("result %+v", res)
				}
				if d := time.Since(start); d > 5*time.Second {
					t.Errorf("took %v", d)
				}
				for _, m := range []string{m1, m2, m3, m4} {
					waitHostGone(t, m)
				}
			})
			t.Run("default timeout from template", func(t *testing.T) {
				res, err := in.Exec(context.Background(), ExecRequest{Command: "sleep 30"})
				if err != nil || res.Reason != ReasonTimeout {
					t.Fatal(res, err)
				}
			})
			t.Run("timeout above the max is clamped", func(t *testing.T) {
				start := time.Now()
				res, err := in.Exec(context.Background(), ExecRequest{Command: "sleep 30", Timeout: time.Hour})
				if err != nil || res.Reason != ReasonTimeout {
					t.Fatal(res, err)
				}
				if d := time.Since(start); d < time.Second || d > 10*time.Second {
					t.Errorf("killed after %v, want about the 1s maximum", d)
				}
			})
			t.Run("cancel", func(t *testing.T) {
				m := marker()
				ctx, cancel := context.WithCancel(context.Background())
				time.AfterFunc(200*time.Millisecond, cancel)
				res, err := in.Exec(ctx, ExecRequest{Command: m + "; echo never", Stdout: &bytes.Buffer{}, Timeout: 30 * time.Second})
				if err != nil || res.Reason != ReasonCancelled || res.Signal != "KILL" {
					t.Fatal(res, err)
				}
				waitHostGone(t, m)
				if _, err := in.Exec(ctx, ExecRequest{Command: "true"}); !errors.Is(err, context.Canceled) {
					t.Errorf("exec with a cancelled context: %v", err)
				}
			})
			t.Run("no reason when it ends on its own", func(t *testing.T) {
				res, err := in.Exec(context.Background(), ExecRequest{Command: "kill -KILL $$"})
				if err != nil || res.Reason != "" || res.Signal != "KILL" || res.ExitCode != 137 {
					t.Fatal(res, err)
				}
			})
		})
	}
}

func TestBackgroundAndLifecycle(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			spec := Spec{ID: NewID(), Template: Template{Name: "t"}}
			if err := p.Create(ctx, spec); err != nil {
				t.Fatal(err)
			}
			if err := p.Create(ctx, spec); err != nil { // idempotent
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Destroy(context.Background(), spec) })
			// A Start whose context ends leaves nothing behind: the next Start works.
			short, cancel := context.WithTimeout(ctx, time.Millisecond)
			if in, err := p.Start(short, spec); err == nil {
				in.Stop(ctx) // a fast machine may make it anyway
			}
			cancel()
			in, err := p.Start(ctx, spec)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.Start(ctx, spec); !errors.Is(err, ErrRunning) {
				t.Errorf("second Start: %v", err)
			}
			if err := p.Destroy(ctx, spec); !errors.Is(err, ErrRunning) {
				t.Errorf("Destroy while running: %v", err)
			}

			// `cmd &` leaves the output pipe open in the background child: Exec must return anyway.
			m1 := marker()
			start := time.Now()
			res, out := sh(t, in, "echo started; "+m1+" &")
			if res.ExitCode != 0 || out != "started\n" {
				t.Fatalf("%+v %q", res, out)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("background & made exec take %v", d)
			}
			if res, out := sh(t, in, "pgrep -f '[s]"+m1[1:]+"'"); res.ExitCode != 0 {
				t.Errorf("background process not visible to a later exec: %+v %q", res, out)
			}

			// Explicit Background: returns at once with a pid that a later exec can see.
			m2 := marker()
			bg, err := in.Exec(ctx, ExecRequest{Command: m2, Background: true})
			if err != nil || bg.Pid <= 0 {
				t.Fatal(bg, err)
			}
			if res, out := sh(t, in, fmt.Sprintf("kill -0 %d && echo alive", bg.Pid)); out != "alive\n" {
				t.Errorf("background pid %d: %+v %q", bg.Pid, res, out)
			}
			if _, err := in.Exec(ctx, ExecRequest{Argv: []string{"no-such-program-xyz"}, Background: true}); err == nil {
				t.Error("background start of a missing program did not fail")
			}

			if _, out := sh(t, in, "echo kept > file.txt && cat file.txt"); out != "kept\n" {
				t.Fatal(out)
			}
			if err := in.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			select {
			case <-in.Done():
			default:
				t.Error("Done not closed after Stop")
			}
			waitHostGone(t, m1)
			waitHostGone(t, m2)
			if _, err := in.Exec(ctx, ExecRequest{Command: "true"}); !errors.Is(err, ErrStopped) {
				t.Errorf("exec after stop: %v", err)
			}
			if err := in.Stop(ctx); err != nil { // idempotent
				t.Error(err)
			}

			// Files survive; the new init is fresh (nothing of the old run is left).
			in2, err := p.Start(ctx, spec)
			if err != nil {
				t.Fatal(err)
			}
			defer in2.Stop(context.Background())
			if _, out := sh(t, in2, "cat file.txt"); out != "kept\n" {
				t.Errorf("file after restart: %q", out)
			}
			if res, _ := sh(t, in2, "pgrep -f '[s]"+m1[1:]+"'"); res.ExitCode == 0 {
				t.Error("old background process visible after restart")
			}
			if err := in2.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			if err := p.Destroy(ctx, spec); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Dir(p.WorkspaceDir(spec))); !os.IsNotExist(err) {
				t.Errorf("sandbox dir after Destroy: %v", err)
			}
		})
	}
}

func TestInitKilledFromHost(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			t.Parallel()
			in, _ := startSandbox(t, p, Template{})
			m := marker()
			pending := make(chan error, 1)
			go func() {
				_, err := in.Exec(context.Background(), ExecRequest{Command: m, Stdout: &bytes.Buffer{}, Timeout: time.Minute})
				pending <- err
			}()
			waitHostRunning(t, m)
			inst := in.(*instance)
			inst.mu.Lock()
			pid := inst.initPid
			inst.mu.Unlock()
			if err := unix.Kill(pid, unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
			select {
			case <-in.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("Done not closed after the init was killed")
			}
			select {
			case err := <-pending:
				if !errors.Is(err, ErrStopped) {
					t.Errorf("pending exec: %v, want ErrStopped", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("pending exec did not return")
			}
			if _, err := in.Exec(context.Background(), ExecRequest{Command: "true"}); !errors.Is(err, ErrStopped) {
				t.Errorf("exec after init death: %v", err)
			}
			waitHostGone(t, m)
		})
	}
}

func TestDestroyRefusesHostileIDs(t *testing.T) {
	victim := t.TempDir()
	if err := os.WriteFile(filepath.Join(victim, "keep"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range providers(t) {
		for _, id := range []string{"../../etc", "sb_../../x", "", "sb_", victim, "sb_00000000-0000-0000-0000-00000000000/", "sb_00000000-0000-0000-0000-000000000000/.."} {
			spec := Spec{ID: id}
			if err := p.Destroy(context.Background(), spec); !errors.Is(err, ErrInvalidID) {
				t.Errorf("%s: Destroy(%q) = %v, want ErrInvalidID", p.Name(), id, err)
			}
			if err := p.Create(context.Background(), spec); !errors.Is(err, ErrInvalidID) {
				t.Errorf("%s: Create(%q) = %v, want ErrInvalidID", p.Name(), id, err)
			}
			if _, err := p.Start(context.Background(), spec); !errors.Is(err, ErrInvalidID) {
				t.Errorf("%s: Start(%q) = %v, want ErrInvalidID", p.Name(), id, err)
			}
			if d := p.WorkspaceDir(spec); d != "" {
				t.Errorf("%s: WorkspaceDir(%q) = %q", p.Name(), id, d)
			}
		}
		if _, err := p.Start(context.Background(), Spec{ID: NewID(), Template: DefaultTemplate()}); !errors.Is(err, ErrNotCreated) {
			t.Errorf("%s: Start before Create: %v", p.Name(), err)
		}
	}
	if _, err := os.Stat(filepath.Join(victim, "keep")); err != nil {
		t.Fatal(err)
	}
}

func TestSandboxCwd(t *testing.T) {
	for in, want := range map[string]string{
		"": "/workspace", "/workspace": "/workspace", "/workspace/": "/workspace", "a/b": "/workspace/a/b",
		"/workspace/a/../b": "/workspace/b", "./a": "/workspace/a",
	} {
		if got, err := sandboxCwd(in); err != nil || got != want {
			t.Errorf("sandboxCwd(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"/", "/etc", "..", "../workspace2", "/workspace/../..", "/workspace2", "a\x00b"} {
		if got, err := sandboxCwd(in); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("sandboxCwd(%q) = %q, %v; want an error", in, got, err)
		}
	}
}
