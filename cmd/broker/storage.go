package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

var nodeRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,63}$`)

// storage is the broker's Redis: the configured one, or the embedded one in the data dir.
type storage struct {
	rdb      redis.UniversalClient
	store    *store.Store
	embedded *store.Embedded // nil when --redis-url is set or another broker runs the embedded one
	lock     *os.File
	// where describes the Redis for logs and /readyz, without credentials.
	where string
}

// openStorage connects to Redis. With no --redis-url it runs the embedded redis-server; the data dir
// lock makes sure one broker at a time owns it. Admin commands (serving=false) that find a broker
// running reach that broker's embedded Redis instead of starting their own.
func openStorage(ctx context.Context, c *config, log *slog.Logger, serving bool) (*storage, error) {
	redis.SetLogger(redisLogger{log})
	// As root, namespace sandboxes run as an unprivileged uid whose bubblewrap must traverse the data
	// dir to reach the workspaces: search (x) but no read for others. What is secret inside (the
	// embedded Redis, the signing keys, the index) is 0700 on its own.
	mode := os.FileMode(0o700)
	if os.Geteuid() == 0 {
		mode = 0o711
	}
	if err := os.MkdirAll(c.DataDir, mode); err != nil {
		return nil, fmt.Errorf("--data-dir (SBX_DATA_DIR): cannot create %s: %v", c.DataDir, err)
	}
	s := &storage{}
	if serving || c.RedisURL == "" {
		lock, err := lockDataDir(c.DataDir)
		switch {
		case err == nil:
			s.lock = lock
		case serving:
			return nil, err
		}
	}
	var opts *redis.UniversalOptions
	switch {
	case c.RedisURL != "":
		o, err := store.ParseRedisURL(c.RedisURL)
		if err != nil {
			return nil, err
		}
		opts, s.where = o, protocol.RedactURL(c.RedisURL)
	case s.lock != nil:
		e, err := store.StartEmbedded(ctx, c.DataDir, log)
		if err != nil {
			s.close()
			return nil, err
		}
		s.embedded, s.where = e, "embedded redis-server at "+e.Addr+" (data in "+e.Dir+")"
		opts = e.Options()
		os.WriteFile(filepath.Join(e.Dir, "addr"), []byte(e.Addr+"\n"), 0o600)
	default:
		// A broker holds the data dir: use its embedded Redis.
		addr, err1 := os.ReadFile(filepath.Join(c.DataDir, "redis", "addr"))
		pass, err2 := os.ReadFile(filepath.Join(c.DataDir, "redis", "password"))
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("a broker is running on %s but its embedded Redis address is unreadable; run this command as the broker's user", c.DataDir)
		}
		opts = &redis.UniversalOptions{Addrs: []string{strings.TrimSpace(string(addr))}, Password: strings.TrimSpace(string(pass))}
		s.where = "the running broker's embedded redis-server"
	}
	store.BoundOptions(opts, c.RedisTimeout)
	s.rdb = redis.NewUniversalClient(opts)
	if err := store.CheckServer(ctx, s.rdb); err != nil {
		s.close()
		return nil, fmt.Errorf("--redis-url (SBX_REDIS_URL): %s: %w", s.where, err)
	}
	s.store = store.NewWithOptions(s.rdb, store.Options{Timeout: c.RedisTimeout, Log: log})
	return s, nil
}

func (s *storage) close() {
	if s.store != nil {
		s.store.Close()
	}
	if s.rdb != nil {
		s.rdb.Close()
	}
	if s.embedded != nil {
		s.embedded.Stop()
	}
	if s.lock != nil {
		s.lock.Close()
	}
}

// lockDataDir takes an exclusive lock so that two brokers never share one data dir (they would run
// two redis-servers on one AOF and two inits per sandbox).
func lockDataDir(dir string) (*os.File, error) {
	path := filepath.Join(dir, "broker.lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("--data-dir (SBX_DATA_DIR): %v", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		b, _ := os.ReadFile(path)
		f.Close()
		return nil, fmt.Errorf("--data-dir (SBX_DATA_DIR): another broker (pid %s) is using %s; stop it or pick another data dir",
			strings.TrimSpace(string(b)), dir)
	}
	f.Truncate(0)
	f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return f, nil
}

// nodeName is --node, or a name generated on first start and kept in the data dir.
func nodeName(c *config) (string, error) {
	if c.Node != "" {
		return c.Node, nil
	}
	path := filepath.Join(c.DataDir, "node-id")
	if b, err := os.ReadFile(path); err == nil && nodeRE.Match([]byte(strings.TrimSpace(string(b)))) {
		return strings.TrimSpace(string(b)), nil
	}
	raw := make([]byte, 4)
	rand.Read(raw)
	name := "node-" + hex.EncodeToString(raw)
	if err := os.WriteFile(path, []byte(name+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("--data-dir: write node id: %w", err)
	}
	return name, nil
}

// redisLogger routes go-redis' own log lines (pool and reconnect trouble, Sentinel failovers)
// through slog, so that --log-format json stays one JSON object per line. go-redis has one
// process-wide logger: set it with redis.SetLogger before the first client is made.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(_ context.Context, format string, v ...any) {
	l.log.Warn(strings.TrimSpace(fmt.Sprintf(format, v...)), "component", "go-redis")
}
