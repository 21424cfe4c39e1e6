package server_test

import (
	"bytes"
	"io"
	"net/http"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
)

// A storm of revocation resubscriptions (Redis flapping) re-checks the event streams' keys one
// pass at a time, with at most one more asked for: here Redis is stopped (SIGSTOP) so that every
// read of a pass waits, and 200 resubscriptions come meanwhile. Before, each started its own pass in
// a goroutine of its own, all reading Redis at once: 200 passes waiting, and as many more as
// resubscriptions came for as long as Redis was slow.
func TestAStormOfResubscriptionsRechecksStreamsOnePassAtATime(t *testing.T) {
	b := servertest.New(t, servertest.Options{Provider: "dir", RedisTimeout: 2 * time.Second})
	ctx := t.Context()
	req, _ := http.NewRequestWithContext(ctx, "GET", b.URL+"/v1/events", nil)
	req.Header.Set("Authorization", "Bearer "+b.Client.APIKey())
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("event stream: %v %v", err, resp)
	}
	defer resp.Body.Close()
	go io.Copy(io.Discard, resp.Body)
	b.Redis.Pause()
	defer b.Redis.Continue()
	for range 200 {
		server.RevocationsMissed(b.Server)
	}
	var buf bytes.Buffer
	pprof.Lookup("goroutine").WriteTo(&buf, 2)
	n := strings.Count(buf.String(), "(*Server).recheckStreamsPasses")
	t.Logf("%d passes run", n)
	if n > 2 {
		t.Errorf("%d passes of the streams' re-check run at once after 200 resubscriptions, want at most 2 (one running, one asked for)", n)
	}
}
