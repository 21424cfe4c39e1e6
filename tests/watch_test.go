package tests

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

var update = flag.Bool("update", false, "rewrite the golden screens in testdata/")

// pane is sbctl running in a tmux window of its own tmux server: the test types with send-keys and
// reads the screen with capture-pane, as a person would see it.
type pane struct {
	t      *testing.T
	socket string
}

// startPane runs sbctl with args in a w x h tmux window, as the person who started b. When sbctl
// exits the window shows "sbctl-exited=CODE".
func startPane(t *testing.T, b *broker, w, h int, args ...string) *pane {
	t.Helper()
	return startPaneThen(t, b, w, h, "", args...)
}

// startPaneThen is startPane that runs the shell commands then (each ended by ";") in the window
// after sbctl exited and before it says so.
func startPaneThen(t *testing.T, b *broker, w, h int, then string, args ...string) *pane {
	t.Helper()
	if _, err := exec.LookPath("tmux"); err != nil {
		t.Fatal("tmux is not installed: run scripts/deps.sh (apt-get install -y tmux)")
	}
	rnd := make([]byte, 6)
	rand.Read(rnd)
	p := &pane{t: t, socket: "sbx-test-" + hex.EncodeToString(rnd)}
	quoted := []string{filepath.Join(bin, "sbctl")}
	for _, a := range args {
		quoted = append(quoted, "'"+strings.ReplaceAll(a, "'", `'\''`)+"'")
	}
	script := "env HOME='" + b.Home + "' XDG_CONFIG_HOME= SBCTL_CONFIG= SBX_API_KEY= SBX_BROKER_URL= " +
		strings.Join(quoted, " ") + "; code=$?; " + then + " echo sbctl-exited=$code; sleep 600"
	p.tmux("new-session", "-d", "-s", "w", "-x", strconv.Itoa(w), "-y", strconv.Itoa(h), script)
	t.Cleanup(func() { exec.Command("tmux", "-L", p.socket, "kill-server").Run() })
	return p
}

func (p *pane) tmux(args ...string) string {
	p.t.Helper()
	out, err := exec.Command("tmux", append([]string{"-L", p.socket, "-f", "/dev/null"}, args...)...).CombinedOutput()
	if err != nil {
		p.t.Fatalf("tmux %v: %v\n%s", args, err, out)
	}
	return string(out)
}

func (p *pane) screen() string { return p.tmux("capture-pane", "-p", "-t", "w") }

// keys types into the window (tmux key names: Enter, BSpace, or literal text).
func (p *pane) keys(keys ...string) {
	p.t.Helper()
	p.tmux(append([]string{"send-keys", "-t", "w"}, keys...)...)
}

// waitFor polls the screen until cond holds, and fails with the last screen after 30 s.
func (p *pane) waitFor(what string, cond func(screen string) bool) string {
	p.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := p.screen()
		if cond(s) {
			return s
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("waiting for %s; the screen is:\n%s", what, s)
		}
		time.Sleep(50 * time.Millisecond) // a poll interval, not a wait for time to pass
	}
}

func (p *pane) waitText(text string) string {
	p.t.Helper()
	return p.waitFor(strconv.Quote(text), func(s string) bool { return strings.Contains(s, text) })
}

func (p *pane) waitMatch(re string) string {
	p.t.Helper()
	r := regexp.MustCompile(re)
	return p.waitFor("/"+re+"/", func(s string) bool { return r.MatchString(s) })
}

// masked replaces what changes from run to run (clock times, ports, key ids, countdowns) so that a
// screen can be compared with a golden one.
func masked(screen string) string {
	for _, r := range []struct{ re, with string }{
		{`\d\d:\d\d:\d\d`, "hh:mm:ss"},
		{`127\.0\.0\.1:\d+`, "127.0.0.1:PORT"},
		{`key:[a-z0-9]+`, "key:KEYID"},
		{`\b\d{1,2}m\d\ds\b`, "MMmSSs"},
		{`\(\d+ms\)`, "(Nms)"},
	} {
		screen = regexp.MustCompile(r.re).ReplaceAllString(screen, r.with)
	}
	var lines []string
	for _, l := range strings.Split(screen, "\n") {
		lines = append(lines, strings.TrimRight(l, " "))
	}
	return strings.TrimRight(strings.Join(lines, "\n"), "\n") + "\n"
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		os.MkdirAll("testdata", 0o755)
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test ./tests -run %s -update writes it)", err, t.Name())
	}
	if got != string(want) {
		t.Errorf("screen %s differs from %s (-update rewrites it):\n--- got\n%s--- want\n%s", name, path, got, want)
	}
}

// sbctl watch in a real terminal (tmux) against a real broker: the screen at 80x24 (golden), the
// keys that stop, resume, extend, filter and delete (with its confirmation), a resize, escapes in
// events shown escaped, and q.
func TestWatch(t *testing.T) {
	b := startBroker(t)
	b.ok("create", "dev", "--tag", "team=infra")
	b.ok("create", "ci", "--tag", "team=web")
	// A broker that is not there is an error on the command line, not a screen that says so.
	down := startPane(t, b, 80, 24, "--broker", "http://127.0.0.1:1", "watch")
	down.waitText("sbctl-exited=6")
	down.waitText("cannot reach the broker")

	p := startPane(t, b, 80, 24, "watch")

	// Both rows with their brokers, and the backlog of events.
	s := p.waitFor("both sandboxes with their nodes and events", func(s string) bool {
		return regexp.MustCompile(`(?m)^> ci .* 127\.0\.0\.1:\d+`).MatchString(s) &&
			regexp.MustCompile(`(?m)^  dev .* 127\.0\.0\.1:\d+`).MatchString(s) && strings.Contains(s, "ci  created")
	})
	golden(t, "watch-80x24", masked(s))

	// A command with an OSC sequence (it would set the window title) is shown escaped.
	b.ok("exec", "dev", "--", "printf", "x\x1b]2;pwned\x07y")
	p.waitText(`printf x\x1b]2;pwned\x07y`)
	if title := p.tmux("display-message", "-p", "-t", "w", "#{pane_title}"); strings.Contains(title, "pwned") {
		t.Fatalf("an escape sequence from an event reached the terminal: the window title is %q", title)
	}

	// The broker restarts: the pane says the stream dropped, reconnects with Last-Event-ID and
	// shows what happens after.
	b.restart()
	b.ok("exec", "dev", "--", "echo", "after-restart")
	p.waitText("exec  echo after-restart  -> exit 0")

	// Select dev, show its events only, stop and resume it.
	p.keys("j")
	p.waitMatch(`(?m)^> dev `)
	p.keys("a")
	p.waitText("── events: dev ")
	p.keys("s")
	p.waitMatch(`(?m)^> dev +stopped `)
	p.waitMatch(`(?m)dev? *stopped +requested|stopped  requested`)
	p.keys("x")
	p.waitText("dev is stopped: resume it (r) before opening a shell")
	p.keys("r")
	p.waitMatch(`(?m)^> dev +running `)

	// x opens a shell on the selected sandbox and comes back to the pane when it ends.
	p.keys("x")
	p.waitText("sbctl: shell on dev; exit or Ctrl-D returns to sbctl watch")
	p.waitMatch(`(?m)^bash-[0-9.]+\$`)
	p.keys("echo in-$((6*7)) $(stty size)", "Enter")
	p.waitText("in-42 24 80")
	p.keys("exit 4", "Enter")
	p.waitText("shell on dev ended: exit 4")
	p.waitMatch(`(?m)^> dev +running `)
	p.waitText("shell_ended  /bin/bash  -> exit 4")

	// Extend: a prompt, then the new lease counting down from 2h.
	p.keys("e")
	p.waitText("New lease for dev")
	p.keys("2h", "Enter")
	p.waitMatch(`(?m)^> dev +running .* (2h00m|1h59m) `)

	// Filter by tag, then clear the filter.
	p.keys("/")
	p.waitText("Filter by tag")
	p.keys("team=web", "Enter")
	s = p.waitText("tag team=web")
	s = p.waitFor("only ci listed", func(s string) bool {
		return regexp.MustCompile(`(?m)^> ci `).MatchString(s) && !regexp.MustCompile(`(?m)^  dev `).MatchString(s)
	})
	p.keys("/")
	p.waitText("Filter by tag (key=value, empty for all): team=web_")
	p.keys("BSpace", "BSpace", "BSpace", "BSpace", "BSpace", "BSpace", "BSpace", "BSpace", "Enter")
	p.waitText("filter cleared")
	p.waitMatch(`(?m)^  dev `)

	// A resize lays the screen out again in the new size.
	p.tmux("resize-window", "-t", "w", "-x", "100", "-y", "30")
	s = p.waitFor("the events rule across 100 columns", func(s string) bool {
		for _, l := range strings.Split(s, "\n") {
			if strings.HasPrefix(l, "── events: ") && utf8.RuneCountInString(l) == 100 && strings.HasSuffix(l, "──") {
				return true
			}
		}
		return false
	})
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) != 30 || !strings.HasPrefix(lines[0], "sbctl watch") || lines[29] != "filter cleared" {
		t.Fatalf("after a resize to 100x30 the screen has %d lines and ends %q:\n%s", len(lines), lines[len(lines)-1], s)
	}
	for _, l := range lines {
		if utf8.RuneCountInString(l) > 100 {
			t.Fatalf("a line is wider than the 100 columns: %q", l)
		}
	}

	// Delete asks first: n keeps the sandbox, y deletes it.
	p.keys("j")
	p.waitMatch(`(?m)^> dev `)
	p.keys("d")
	p.waitText("Delete sandbox dev and all its files? [y/N]")
	p.keys("n")
	p.waitText("dev kept: nothing deleted")
	b.ok("get", "dev")
	p.keys("d")
	p.waitText("Delete sandbox dev and all its files? [y/N]")
	p.keys("y")
	p.waitText("deleted dev")
	p.waitFor("dev gone from the list", func(s string) bool { return !regexp.MustCompile(`(?m)^[> ] dev `).MatchString(s) })
	if r := b.sbctl("get", "dev"); r.code != 3 {
		t.Fatalf("dev after delete in watch: exit %d %s", r.code, r.stderr)
	}

	p.keys("q")
	p.waitText("sbctl-exited=0")
}

// Without a terminal, watch prints the list once and then one line per event, escaped.
func TestWatchPlain(t *testing.T) {
	b := startBroker(t)
	b.ok("create", "dev", "--tag", "team=infra")
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "sbctl"), "watch")
	cmd.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY=", "SBX_BROKER_URL=")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	lines := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	var seen []string
	want := func(re string) {
		t.Helper()
		r := regexp.MustCompile(re)
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatalf("sbctl watch ended before a line matching %q:\n%s", re, strings.Join(seen, "\n"))
				}
				seen = append(seen, l)
				if strings.ContainsAny(l, "\x1b\x07") {
					t.Fatalf("a raw escape reached stdout: %q", l)
				}
				if r.MatchString(l) {
					return
				}
			case <-ctx.Done():
				t.Fatalf("no line matching %q:\n%s", re, strings.Join(seen, "\n"))
			}
		}
	}
	want(`^NAME +ID +STATUS`)
	want(`^dev +sb_\S+ +running .*team=infra`)
	want(`^\d\d:\d\d:\d\d dev +created`)
	b.ok("exec", "dev", "--", "printf", "\x1b]2;pwned\x07")
	want(`^\d\d:\d\d:\d\d dev +exec +printf \\x1b\]2;pwned\\x07 +-> exit 0`)

	// Across a broker restart the stream resumes where it was: later events come, none twice.
	b.restart()
	b.ok("exec", "dev", "--", "echo", "after-restart")
	want(`^\d\d:\d\d:\d\d dev +exec +echo after-restart +-> exit 0`)
	created := 0
	for _, l := range seen {
		if regexp.MustCompile(`^\d\d:\d\d:\d\d dev +created`).MatchString(l) {
			created++
		}
	}
	if created != 1 {
		t.Fatalf("dev's created event shown %d times across the restart:\n%s", created, strings.Join(seen, "\n"))
	}
}
