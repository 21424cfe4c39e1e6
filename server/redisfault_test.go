package server_test

import (
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// A hung Redis (SIGSTOP: connections open, nothing answers) costs a caller about one
// --redis-timeout (1 s) and a clear 503, not a hang: a read, a heartbeat, and a crowd of heartbeats
// at once, none of which waits behind another's stuck pipeline. When Redis thaws, calls work again.
func TestHungRedisAnswers503Fast(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.Heartbeat(ctx, "dev"); err != nil {
		t.Fatal(err)
	}
	b.Redis.Pause()
	thawed := false
	defer func() {
		if !thawed {
			b.Redis.Continue()
		}
	}()
	// A second is the bound; scheduling on a loaded machine gets the rest.
	const limit = 3500 * time.Millisecond
	timed := func(what string, call func() error) time.Duration {
		start := time.Now()
		err := call()
		took := time.Since(start)
		if code(err) != protocol.CodeUnavailable {
			t.Errorf("%s with Redis hung: %v, want 503 unavailable", what, err)
		}
		if took > limit {
			t.Errorf("%s with Redis hung took %s, want about 1s", what, took)
		}
		return took
	}
	// The crowd comes first, while the API key is in the broker's 2 s cache: its heartbeats reach the
	// store's pipelined batcher rather than failing at authentication.
	const crowd = 200
	var wg sync.WaitGroup
	var mu sync.Mutex
	var slowest time.Duration
	for range crowd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := timed("one of many heartbeats", func() error { _, err := b.Client.Heartbeat(ctx, "dev"); return err })
			mu.Lock()
			slowest = max(slowest, d)
			mu.Unlock()
		}()
	}
	wg.Wait()
	get := timed("get", func() error { _, err := b.Client.GetSandbox(ctx, "dev"); return err })
	one := timed("heartbeat", func() error { _, err := b.Client.Heartbeat(ctx, "dev"); return err })
	t.Logf("with Redis hung: get answered in %s, a heartbeat in %s, the slowest of %d concurrent heartbeats in %s",
		get.Round(time.Millisecond), one.Round(time.Millisecond), crowd, slowest.Round(time.Millisecond))

	b.Redis.Continue()
	thawed = true
	if err := wait.For(5*time.Second, func() error { _, err := b.Client.Heartbeat(ctx, "dev"); return err }); err != nil {
		t.Fatalf("heartbeats still fail 5s after Redis thawed: %v", err)
	}
}
