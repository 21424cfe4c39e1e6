// Package tests holds end-to-end tests: they build the real broker and sbctl binaries, start the
// broker on its embedded defaults (a real redis-server child, real sandboxes) in a temp data dir,
// and drive sbctl as a person would.
package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider"
)

var bin string // directory holding the built broker and sbctl

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sbx-e2e-bin-")
	if err != nil {
		panic(err)
	}
	for _, name := range []string{"broker", "sbctl", "sbx-init"} {
		build := func(flags ...string) *exec.Cmd {
			cmd := exec.Command("go", append(append([]string{"build"}, flags...), "-o", filepath.Join(dir, name), "../cmd/"+name)...)
			cmd.Stderr = os.Stderr
			if name == "sbx-init" {
				cmd.Env = append(os.Environ(), "CGO_ENABLED=0") // as scripts/broker.sh builds it: static
			}
			return cmd
		}
		// -buildvcs=auto over a GOFLAGS=-buildvcs=false: --version names the commit (TestVersion);
		// where git refuses the checkout (another owner), the build goes on without it.
		if err := build("-buildvcs=auto").Run(); err == nil {
			continue
		}
		if err := build().Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building", name, "failed:", err)
			os.Exit(1)
		}
	}
	for _, tool := range []string{"redis-server"} {
		if _, err := exec.LookPath(tool); err != nil {
			fmt.Fprintf(os.Stderr, "%s is not installed: run scripts/deps.sh (apt-get install -y redis-server bubblewrap)\n", tool)
			os.Exit(1)
		}
	}
	bin = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// broker is a broker process started by a test.
type broker struct {
	t       *testing.T
	URL     string
	DataDir string
	Home    string // HOME of the broker and of sbctl: the bootstrap config lands here
	args    []string
	env     []string // added to the broker's environment
	// provider is the provider the broker must report on /readyz ("namespace" unless a test asks
	// for the dir provider on purpose).
	provider string
	cmd      *exec.Cmd
	log      *bytes.Buffer
	exited   chan struct{}
}

// startBroker starts `broker` with its embedded defaults in a fresh data dir and waits until ready.
func startBroker(t *testing.T, extra ...string) *broker {
	t.Helper()
	home := t.TempDir()
	t.Cleanup(func() { provider.UnmountUnder(home) }) // runs before TempDir's removal, after b.stop
	// The namespace provider's bwrap runs as the sandbox uid and must reach the data dir.
	os.Chmod(filepath.Dir(home), 0o711)
	os.Chmod(home, 0o711)
	b := &broker{t: t, Home: home, DataDir: filepath.Join(home, "data"), args: extra, provider: "namespace"}
	b.start()
	t.Cleanup(b.stop)
	return b
}

func (b *broker) start() {
	b.t.Helper()
	if b.URL == "" {
		b.URL = "http://" + freeAddr(b.t)
	}
	args := append([]string{"--listen", strings.TrimPrefix(b.URL, "http://"), "--data-dir", b.DataDir, "--log-level", "debug"}, b.args...)
	b.cmd = exec.Command(filepath.Join(bin, "broker"), args...)
	b.cmd.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "XDG_DATA_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY=", "SBX_BROKER_URL=")
	b.cmd.Env = append(b.cmd.Env, b.env...)
	b.log = &bytes.Buffer{}
	b.cmd.Stdout, b.cmd.Stderr = b.log, b.log
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := b.cmd.Start(); err != nil {
		b.t.Fatal(err)
	}
	b.exited = make(chan struct{})
	go func() { b.cmd.Wait(); close(b.exited) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(b.URL + "/readyz")
		if err == nil {
			var ready struct{ Provider string }
			json.NewDecoder(resp.Body).Decode(&ready)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				// These tests are about real sandboxes: never pass on the no-isolation fallback.
				if ready.Provider != b.provider {
					b.t.Fatalf("the broker chose the %q provider, not namespace (bubblewrap): install it with scripts/deps.sh\n%s", ready.Provider, b.log)
				}
				return
			}
		}
		select {
		case <-b.exited:
			b.t.Fatalf("broker exited during start:\n%s", b.log)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("broker not ready after 30s:\n%s", b.log)
		}
	}
}

// stop sends SIGTERM (a graceful shutdown) and waits.
func (b *broker) stop() {
	if b.cmd == nil || b.cmd.Process == nil {
		return
	}
	select {
	case <-b.exited:
		return
	default:
	}
	b.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-b.exited:
	case <-time.After(30 * time.Second):
		syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
		<-b.exited
		b.t.Errorf("broker did not stop within 30s of SIGTERM:\n%s", b.log)
	}
}

// restart stops the broker and starts it again on the same data dir and address.
func (b *broker) restart() {
	b.stop()
	b.start()
}

// result is one sbctl run.
type result struct {
	stdout, stderr string
	code           int
}

// sbctl runs sbctl as the person who started the broker (same HOME: the bootstrap config).
func (b *broker) sbctl(args ...string) result {
	b.t.Helper()
	return b.sbctlIn("", args...)
}

func (b *broker) sbctlIn(stdin string, args ...string) result {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "sbctl"), args...)
	cmd.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY=", "SBX_BROKER_URL=")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	cmd.Stdin = strings.NewReader(stdin)
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if err != nil {
		b.t.Fatalf("sbctl %v: %v", args, err)
	}
	return r
}

// ok runs sbctl and fails the test unless it exits 0.
func (b *broker) ok(args ...string) string {
	b.t.Helper()
	r := b.sbctl(args...)
	if r.code != 0 {
		b.t.Fatalf("sbctl %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
