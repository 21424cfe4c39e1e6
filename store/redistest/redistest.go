// Package redistest starts a real redis-server for tests, on a free loopback port, and stops it when
// the test ends. It never mocks Redis: a machine without redis-server fails the test with the command
// that installs it.
package redistest

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Server is a running redis-server.
type Server struct {
	// Addr is host:port on 127.0.0.1.
	Addr string
	// URL is redis://Addr, the form --redis-url takes.
	URL    string
	cmd    *exec.Cmd
	exited chan struct{}
	bin    string
	args   []string // the command line, to restart it as it was
	dir    string
}

// Start starts a redis-server with no persistence and returns once it answers PING. It is stopped
// (and its data gone) when t ends.
func Start(t testing.TB) *Server {
	t.Helper()
	return start(t)
}

// StartOn starts a redis-server as Start does, listening on ip too (with protected mode off: it
// has no password), for clients on other hosts or in pods; URL names ip.
func StartOn(t testing.TB, ip string) *Server {
	t.Helper()
	s := start(t, "--bind", "127.0.0.1", ip, "--protected-mode", "no")
	_, port, _ := net.SplitHostPort(s.Addr)
	s.URL = "redis://" + net.JoinHostPort(ip, port)
	return s
}

func start(t testing.TB, extra ...string) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redis-server not found on PATH: these tests use a real Redis. Install it with " +
			"`apt-get install -y redis-server` (scripts/test.sh does this for you)")
	}
	dir := t.TempDir()
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		port, err := freePort()
		if err != nil {
			t.Fatalf("redistest: find a free port: %v", err)
		}
		s := &Server{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), bin: bin, dir: dir}
		s.URL = "redis://" + s.Addr
		s.args = append([]string{"--bind", "127.0.0.1", "--port", strconv.Itoa(port),
			"--save", "", "--appendonly", "no", "--dir", dir,
			"--logfile", filepath.Join(dir, "redis.log")}, extra...)
		if err := s.run(); err != nil {
			t.Fatalf("redistest: start redis-server: %v", err)
		}
		if lastErr = s.waitReady(5 * time.Second); lastErr == nil {
			t.Cleanup(s.stop)
			return s
		}
		s.stop() // most likely lost the port to another process; try another
	}
	t.Fatalf("redistest: redis-server did not become ready: %v (log in %s)", lastErr, dir)
	return nil
}

// Client returns a client for the server, closed when t ends.
func (s *Server) Client(t testing.TB) redis.UniversalClient {
	c := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{s.Addr}})
	t.Cleanup(func() { c.Close() })
	return c
}

func (s *Server) waitReady(limit time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(limit)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("ping %s: %w", s.Addr, err)
		}
		select {
		case <-s.exited:
			return fmt.Errorf("redis-server exited: %w", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func (s *Server) run() error {
	s.cmd = exec.Command(s.bin, s.args...)
	if err := s.cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	s.exited = exited
	cmd := s.cmd
	go func() { cmd.Wait(); close(exited) }()
	return nil
}

// Pause freezes the server with SIGSTOP, as a hung Redis: connections stay open and nothing answers.
// Continue thaws it. The test's cleanup thaws a paused server before stopping it.
func (s *Server) Pause() { s.cmd.Process.Signal(syscall.SIGSTOP) }

// Continue thaws a server frozen by Pause.
func (s *Server) Continue() { s.cmd.Process.Signal(syscall.SIGCONT) }

// Stop shuts the server down with its data saved (SHUTDOWN SAVE), as an operator stopping Redis
// for maintenance would; Restart brings it back on the same address with that data.
func (s *Server) Stop(t testing.TB) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
	defer c.Close()
	c.Do(context.Background(), "SHUTDOWN", "SAVE") // the connection closes: no answer to check
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		t.Fatalf("redistest: redis-server at %s did not shut down", s.Addr)
	}
}

// Restart starts a server stopped by Stop again, on the same address and data, and returns once it
// answers PING.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	if err := s.run(); err != nil {
		t.Fatalf("redistest: restart redis-server: %v", err)
	}
	if err := s.waitReady(10 * time.Second); err != nil {
		t.Fatalf("redistest: restarted redis-server at %s: %v (log in %s)", s.Addr, err, s.dir)
	}
}

// Kill stops the server now, as a crash would (tests of what clients do without Redis). It is
// safe to call before the test's own cleanup, which then does nothing.
func (s *Server) Kill() { s.stop() }

func (s *Server) stop() {
	s.cmd.Process.Kill()
	s.cmd.Process.Signal(syscall.SIGCONT) // a paused server dies only once thawed
	<-s.exited
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// StartCluster starts a Redis Cluster of three masters (no replicas) and returns a cluster client
// for it, closed when t ends. Multi-key commands and scripts whose keys span slots fail on it as on
// any Cluster, which is what the tests that use it check.
func StartCluster(t testing.TB) redis.UniversalClient {
	t.Helper()
	nodes := make([]*Server, 3)
	for i := range nodes {
		dir := t.TempDir()
		nodes[i] = start(t, "--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, "nodes.conf"))
	}
	ctx := context.Background()
	const slots = 16384
	addrs := make([]string, len(nodes))
	for i, n := range nodes {
		addrs[i] = n.Addr
		c := redis.NewClient(&redis.Options{Addr: n.Addr})
		from, to := i*slots/len(nodes), (i+1)*slots/len(nodes)-1
		err := c.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", from, to).Err()
		// Each node meets every other, so that none waits on gossip to learn of a third: a CI run
		// found one node still knowing only two after 10 s when each had met the first alone.
		for j, other := range nodes {
			if err == nil && j != i {
				host, port, _ := net.SplitHostPort(other.Addr)
				err = c.ClusterMeet(ctx, host, port).Err()
			}
		}
		c.Close()
		if err != nil {
			t.Fatalf("redistest: form the cluster at %s: %v", n.Addr, err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, n := range nodes {
		c := redis.NewClient(&redis.Options{Addr: n.Addr})
		for {
			info, err := c.ClusterInfo(ctx).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, "cluster_known_nodes:3") {
				break
			}
			if time.Now().After(deadline) {
				c.Close()
				t.Fatalf("redistest: cluster at %s not ready after 30s: %v %s", n.Addr, err, info)
			}
			time.Sleep(20 * time.Millisecond)
		}
		c.Close()
	}
	c := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: addrs, IsClusterMode: true})
	t.Cleanup(func() { c.Close() })
	return c
}
