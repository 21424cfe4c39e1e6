package store

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// Embedded is a redis-server the broker runs as its child when no --redis-url is given.
//
// Why a real redis-server and not an in-process imitation: the broker's correctness rests on Lua
// scripts, sorted-set ranges and streams, and an imitation differs from Redis exactly there; and the
// embedded default must not lose sandboxes across a restart, which Redis' append-only file gives us
// (fsync every second; a crash of the broker or of Redis itself loses nothing already written).
//
// It listens on 127.0.0.1 on a free port with a random password kept in the data dir (0600), so
// other users of the machine cannot reach it, and it dies with the broker (SIGTERM through
// PDEATHSIG, which makes Redis flush its AOF).
type Embedded struct {
	// Addr and Password are what a client needs.
	Addr     string
	Password string
	Dir      string
	cmd      *exec.Cmd
	exited   chan struct{}
}

// ErrNoRedisServer means the embedded default cannot start because redis-server is missing.
var ErrNoRedisServer = errors.New("redis-server is not on PATH: install it (apt-get install -y redis-server) or point --redis-url at a Redis")

// StartEmbedded starts redis-server with its data in dataDir/redis and waits until it answers.
func StartEmbedded(ctx context.Context, dataDir string, log *slog.Logger) (*Embedded, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, ErrNoRedisServer
	}
	dir := filepath.Join(dataDir, "redis")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("embedded redis: %w", err)
	}
	password, err := loadOrCreateSecret(filepath.Join(dir, "password"))
	if err != nil {
		return nil, err
	}
	stopStale(filepath.Join(dir, "redis.pid"), log)

	for attempt := 0; ; attempt++ {
		port, err := freeLoopbackPort()
		if err != nil {
			return nil, fmt.Errorf("embedded redis: find a port: %w", err)
		}
		e := &Embedded{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Password: password, Dir: dir, exited: make(chan struct{})}
		// The config goes through stdin so the password never shows in ps.
		conf := strings.Join([]string{
			"bind 127.0.0.1", "port " + strconv.Itoa(port), "protected-mode yes",
			"requirepass " + password, "dir " + dir, "pidfile " + filepath.Join(dir, "redis.pid"),
			"logfile " + filepath.Join(dir, "redis.log"), "daemonize no",
			"appendonly yes", "appendfsync everysec", "save 300 1",
		}, "\n") + "\n"
		e.cmd = exec.Command(bin, "-")
		e.cmd.Stdin = strings.NewReader(conf)
		e.cmd.Dir = dir
		e.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM, Setpgid: true}
		if err := e.cmd.Start(); err != nil {
			return nil, fmt.Errorf("embedded redis: start %s: %w", bin, err)
		}
		go func() { e.cmd.Wait(); close(e.exited) }()
		err = e.waitReady(ctx, 10*time.Second)
		if err == nil {
			log.Info("embedded redis started", "addr", e.Addr, "dir", dir, "persistence", "appendonly, fsync every second")
			return e, nil
		}
		e.Stop()
		if attempt == 3 {
			return nil, fmt.Errorf("embedded redis did not start: %w (see %s)", err, filepath.Join(dir, "redis.log"))
		}
	}
}

// Options returns go-redis options for the embedded server.
func (e *Embedded) Options() *redis.UniversalOptions {
	return &redis.UniversalOptions{Addrs: []string{e.Addr}, Password: e.Password}
}

// Stop shuts Redis down (it flushes the AOF on SIGTERM) and waits for it.
func (e *Embedded) Stop() {
	select {
	case <-e.exited:
		return
	default:
	}
	e.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-e.exited:
	case <-time.After(10 * time.Second):
		e.cmd.Process.Kill()
		<-e.exited
	}
}

// Exited is closed if the server exits.
func (e *Embedded) Exited() <-chan struct{} { return e.exited }

func (e *Embedded) waitReady(ctx context.Context, limit time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: e.Addr, Password: e.Password, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(limit)
	for {
		pctx, cancel := context.WithTimeout(ctx, 250*time.Millisecond)
		err := c.Ping(pctx).Err()
		cancel()
		if err == nil {
			// Loading the AOF answers LOADING until done; Ping succeeds only after.
			return nil
		}
		select {
		case <-e.exited:
			return fmt.Errorf("redis-server exited: %v", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return err
		}
	}
}

// stopStale stops a redis-server left running on this data dir by a broker that could not stop it.
func stopStale(pidfile string, log *slog.Logger) {
	b, err := os.ReadFile(pidfile)
	if err != nil {
		return
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !bytes.Contains(cmdline, []byte("redis-server")) {
		return
	}
	log.Warn("stopping a stale embedded redis-server left by an earlier broker", "pid", pid)
	syscall.Kill(pid, syscall.SIGTERM)
	for i := 0; i < 200; i++ {
		if syscall.Kill(pid, 0) != nil {
			return
		}
		time.Sleep(25 * time.Millisecond)
	}
	syscall.Kill(pid, syscall.SIGKILL)
}

func loadOrCreateSecret(path string) (string, error) {
	if b, err := os.ReadFile(path); err == nil && len(bytes.TrimSpace(b)) >= 32 {
		return string(bytes.TrimSpace(b)), nil
	}
	raw := make([]byte, 24)
	rand.Read(raw)
	s := hex.EncodeToString(raw)
	if err := os.WriteFile(path, []byte(s+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("embedded redis: write password: %w", err)
	}
	return s, nil
}

func freeLoopbackPort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// CheckServer verifies that the Redis behind rdb is new enough: 7.0, for XINFO STREAM's
// entries-added, which tells an event resume whether trimming lost events (6.2 reports 0, and a
// resume would skip them silently). The scripts need only 6.2 (ZRANGE BYSCORE).
func CheckServer(ctx context.Context, rdb redis.UniversalClient) error {
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return fmt.Errorf("cannot reach Redis: %w", err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
			major, _ := strconv.Atoi(strings.SplitN(v, ".", 2)[0])
			if major < 7 {
				return fmt.Errorf("Redis %s is too old: the broker needs 7.0 or newer", v)
			}
			return nil
		}
	}
	return nil
}
