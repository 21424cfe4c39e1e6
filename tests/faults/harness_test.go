// Package faults is the fault suite: it builds the real broker and sbctl, starts a real
// redis-server of its own and brokers on it, and breaks them as infrastructure breaks: Redis
// stopped, hung (SIGSTOP) or flushed, a broker killed with SIGKILL among two, connections cut.
// The failure-modes table of docs/operations.md names the test of each fault.
//
// The short variants run with `go test ./...` (and so .ci/run). SBX_FAULTS_LONG=1 runs the long
// ones: a 3-minute Redis outage with 30 s leases, 25 kill rounds, 200 leases expiring together.
package faults

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

var bin string // directory holding the built broker, sbctl and sbx-init

// long reports whether the long variants run (SBX_FAULTS_LONG=1).
func long() bool { return os.Getenv("SBX_FAULTS_LONG") == "1" }

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sbx-faults-bin-")
	if err != nil {
		panic(err)
	}
	for _, name := range []string{"broker", "sbctl", "sbx-init"} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, name), "../../cmd/"+name)
		cmd.Stderr = os.Stderr
		if name == "sbx-init" {
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0") // as scripts/broker.sh builds it: static
		}
		if err := cmd.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building", name, "failed:", err)
			os.Exit(1)
		}
	}
	for _, tool := range []string{"redis-server", "bwrap"} {
		if _, err := exec.LookPath(tool); err != nil {
			fmt.Fprintf(os.Stderr, "%s is not installed: run scripts/deps.sh\n", tool)
			os.Exit(1)
		}
	}
	bin = dir
	redis.SetLogger(quiet{}) // the test's own client logs every refused dial while Redis is down
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...interface{}) {}

// eventually polls cond every 50 ms until it holds or d passes, then fails with what.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// searchableDir is a temp dir the sandbox uids can search (the namespace provider needs it).
func searchableDir(t *testing.T) string {
	d := t.TempDir()
	os.Chmod(filepath.Dir(d), 0o711)
	os.Chmod(d, 0o711)
	return d
}

// redisProc is a redis-server the test owns: it can stop it (its data kept on disk), start it
// again on the same port, freeze it and flush it.
type redisProc struct {
	t      *testing.T
	Addr   string
	dir    string
	cmd    *exec.Cmd
	exited chan struct{}
	rdb    *redis.Client
}

// startRedis starts a redis-server of the test's own, its data in an append-only file.
func startRedis(t *testing.T) *redisProc {
	t.Helper()
	r := &redisProc{t: t, Addr: freeAddr(t), dir: t.TempDir()}
	r.rdb = redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	r.start()
	t.Cleanup(func() { r.rdb.Close(); r.kill() })
	return r
}

func (r *redisProc) start() {
	r.t.Helper()
	_, port, _ := net.SplitHostPort(r.Addr)
	args := []string{"--port", port, "--bind", "127.0.0.1", "--dir", r.dir, "--appendonly", "yes",
		"--appendfsync", "always", "--save", "", "--daemonize", "no", "--logfile", "redis.log"}
	r.cmd = exec.Command("redis-server", args...)
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := r.cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	r.exited = make(chan struct{})
	exited := r.exited
	go func() { r.cmd.Wait(); close(exited) }()
	eventually(r.t, 20*time.Second, "redis-server did not answer PING", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return r.rdb.Ping(ctx).Err() == nil
	})
}

// stop shuts Redis down (its data stays in the append-only file) and waits until it is gone.
func (r *redisProc) stop() {
	r.t.Helper()
	r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.exited:
	case <-time.After(20 * time.Second):
		r.t.Fatal("redis-server did not stop within 20s of SIGTERM")
	}
}

func (r *redisProc) kill() {
	if r.cmd == nil || r.cmd.Process == nil {
		return
	}
	syscall.Kill(-r.cmd.Process.Pid, syscall.SIGCONT)
	syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
	<-r.exited
}

// freeze sends SIGSTOP: connections stay open, nothing answers. thaw sends SIGCONT.
func (r *redisProc) freeze() { syscall.Kill(r.cmd.Process.Pid, syscall.SIGSTOP) }
func (r *redisProc) thaw()   { syscall.Kill(r.cmd.Process.Pid, syscall.SIGCONT) }

func (r *redisProc) flushAll() {
	r.t.Helper()
	if err := r.rdb.FlushAll(context.Background()).Err(); err != nil {
		r.t.Fatal(err)
	}
}

// apiKey creates an org's API key with `broker keys create`, as an operator does.
func (r *redisProc) apiKey(org string) string {
	r.t.Helper()
	out, err := exec.Command(filepath.Join(bin, "broker"), "keys", "create", "--org", org, "--name", "faults",
		"-o", "key", "--redis-url", "redis://"+r.Addr).CombinedOutput()
	if err != nil {
		r.t.Fatalf("broker keys create: %v\n%s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// broker is a broker process on the test's Redis.
type broker struct {
	t       *testing.T
	URL     string
	DataDir string
	Node    string
	redis   *redisProc
	args    []string
	cmd     *exec.Cmd
	logMu   sync.Mutex
	log     *bytes.Buffer
	exited  chan struct{}
}

type syncWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// Log is what the broker printed so far.
func (b *broker) Log() string {
	b.logMu.Lock()
	defer b.logMu.Unlock()
	return b.log.String()
}

// startBroker starts a broker named node on r with the namespace provider and waits until ready.
func startBroker(t *testing.T, r *redisProc, node string, extra ...string) *broker {
	t.Helper()
	home := searchableDir(t)
	b := &broker{t: t, URL: "http://" + freeAddr(t), DataDir: filepath.Join(home, "data"), Node: node, redis: r, args: extra}
	t.Cleanup(func() { provider.UnmountUnder(home) }) // runs after b.stop, before TempDir's removal
	// Runs after b.stop: a failed test shows why, from the broker's side.
	t.Cleanup(func() {
		if t.Failed() {
			log := b.Log()
			if len(log) > 32<<10 {
				log = "..." + log[len(log)-32<<10:]
			}
			t.Logf("broker %s log:\n%s", node, log)
		}
	})
	b.start()
	t.Cleanup(b.stop)
	return b
}

func (b *broker) start() {
	defer func(t0 time.Time) { b.t.Logf("broker %s start took %s", b.Node, time.Since(t0)) }(time.Now())
	b.t.Helper()
	args := append([]string{"--listen", strings.TrimPrefix(b.URL, "http://"), "--data-dir", b.DataDir,
		"--redis-url", "redis://" + b.redis.Addr, "--node", b.Node, "--provider", "namespace", "--log-level", "debug"}, b.args...)
	b.cmd = exec.Command(filepath.Join(bin, "broker"), args...)
	b.cmd.Env = append(os.Environ(), "HOME="+filepath.Dir(b.DataDir), "XDG_CONFIG_HOME=", "XDG_DATA_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY=", "SBX_BROKER_URL=")
	b.log = &bytes.Buffer{}
	w := syncWriter{&b.logMu, b.log}
	b.cmd.Stdout, b.cmd.Stderr = w, w
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := b.cmd.Start(); err != nil {
		b.t.Fatal(err)
	}
	b.exited = make(chan struct{})
	exited := b.exited
	go func() { b.cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get(b.URL + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		select {
		case <-b.exited:
			b.t.Fatalf("broker %s exited during start:\n%s", b.Node, b.Log())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("broker %s not ready after 60s:\n%s", b.Node, b.Log())
		}
	}
}

// stop sends SIGTERM (a graceful shutdown) and waits.
func (b *broker) stop() {
	defer func(t0 time.Time) { b.t.Logf("broker %s stop took %s", b.Node, time.Since(t0)) }(time.Now())
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
	case <-time.After(40 * time.Second):
		syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
		<-b.exited
		b.t.Errorf("broker %s did not stop within 40s of SIGTERM:\n%s", b.Node, b.Log())
	}
}

// kill9 kills the broker with SIGKILL, the broker alone (not its process group: what the kernel
// does to its children is part of what is tested), and waits for it.
func (b *broker) kill9() {
	b.cmd.Process.Signal(syscall.SIGKILL)
	<-b.exited
}

// client is a Go SDK client of this broker with key.
func (b *broker) client(key string) *client.Client {
	b.t.Helper()
	c, err := client.New(b.URL, key)
	if err != nil {
		b.t.Fatal(err)
	}
	c.SetHTTPClient(&http.Client{Timeout: 30 * time.Second})
	return c
}

// result is one sbctl run.
type result struct {
	stdout, stderr string
	code           int
	took           time.Duration
}

// sbctl runs sbctl against this broker with key.
func (b *broker) sbctl(key string, args ...string) result {
	b.t.Helper()
	return runSbctl(b.t, b.URL, key, args...)
}

func runSbctl(t *testing.T, url, key string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "sbctl"), args...)
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir(), "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY="+key, "SBX_BROKER_URL="+url)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String(), took: time.Since(start)}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("sbctl %v: %v", args, err)
	}
	return r
}

// ok runs sbctl and fails the test unless it exits 0.
func (b *broker) ok(key string, args ...string) string {
	b.t.Helper()
	r := b.sbctl(key, args...)
	if r.code != 0 {
		b.t.Fatalf("sbctl %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

// create makes a running sandbox named name with a lease of ttl through c.
func create(t *testing.T, c *client.Client, name string, ttl time.Duration) protocol.Sandbox {
	t.Helper()
	secs := int64(ttl / time.Second)
	res, err := c.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: name, TTLSeconds: &secs})
	if err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	return res.Sandbox
}

// orgEvents reads an org's whole event stream from Redis, oldest first (the test's own view of
// what the brokers wrote, independent of the SSE path).
func (r *redisProc) orgEvents(org string) []protocol.Event {
	r.t.Helper()
	msgs, err := r.rdb.XRange(context.Background(), store.EventsKey(org), "-", "+").Result()
	if err != nil && err != redis.Nil {
		r.t.Fatal(err)
	}
	var out []protocol.Event
	for _, m := range msgs {
		for _, v := range m.Values {
			var e protocol.Event
			if s, ok := v.(string); ok && json.Unmarshal([]byte(s), &e) == nil && e.Type != "" {
				e.ID = m.ID
				out = append(out, e)
			}
		}
	}
	return out
}

// of keeps the events of sandbox id (every sandbox when id is empty) of the given types (all when none).
func of(evs []protocol.Event, id string, types ...string) []protocol.Event {
	var out []protocol.Event
	for _, e := range evs {
		if id != "" && e.SandboxID != id {
			continue
		}
		if len(types) == 0 {
			out = append(out, e)
			continue
		}
		for _, ty := range types {
			if e.Type == ty {
				out = append(out, e)
			}
		}
	}
	return out
}

// metric reads one unlabelled (or fully labelled) series from the broker's /metrics.
func (b *broker) metric(series string) float64 {
	b.t.Helper()
	resp, err := http.Get(b.URL + "/metrics")
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	buf.ReadFrom(resp.Body)
	for _, line := range strings.Split(buf.String(), "\n") {
		if strings.HasPrefix(line, series+" ") {
			v, _ := strconv.ParseFloat(strings.TrimSpace(strings.TrimPrefix(line, series)), 64)
			return v
		}
	}
	b.t.Fatalf("no series %s on /metrics", series)
	return 0
}

// get reads a sandbox through c. Right after Redis returns a call may still meet a connection of
// the outage and answer 503 unavailable (retry): get retries those for a few seconds, as clients do.
func get(t *testing.T, c *client.Client, ref string) protocol.Sandbox {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		sb, err := c.GetSandbox(context.Background(), ref)
		if err == nil {
			return sb
		}
		var pe *protocol.Error
		if !errors.As(err, &pe) || pe.Code != protocol.CodeUnavailable || time.Now().After(deadline) {
			t.Fatalf("get %s: %v", ref, err)
		}
		t.Logf("get %s: %v (retrying)", ref, err)
		time.Sleep(100 * time.Millisecond)
	}
}

func clientListRunning() client.ListOptions {
	return client.ListOptions{Statuses: []string{protocol.StatusRunning}}
}
