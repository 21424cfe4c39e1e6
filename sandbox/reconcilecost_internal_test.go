package sandbox

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// Every sandbox hosted here is read from Redis on every reconcile pass (every 5 s), stopped ones
// too, and since a restart every one found at Recover. A stopped sandbox with nothing running here
// costs that one read, not a second one to stop what is not there: with thousands of stopped
// sandboxes, a pass must stay within its interval.
func TestAReconcilePassReadsAStoppedSandboxOnce(t *testing.T) {
	ctx := t.Context()
	m, _, srv := testManager(t, time.Now)
	c := Caller{Org: "o", Actor: "key:k"}
	const n = 12
	for i := range n {
		createdAndStopped(t, m, c, "s"+strconv.Itoa(i))
	}
	rdb := srv.Client(t)
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	m.Reconcile(ctx)
	stats, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	// Each read is one script call (EVALSHA); the commands the script runs are counted apart.
	calls := 0
	for _, line := range strings.Split(stats, "\n") {
		if rest, ok := strings.CutPrefix(line, "cmdstat_evalsha:calls="); ok {
			v, _, _ := strings.Cut(rest, ",")
			calls, _ = strconv.Atoi(v)
		}
	}
	if calls > n {
		t.Fatalf("one reconcile pass over %d stopped sandboxes made %d reads of Redis, want one each\n%s", n, calls, stats)
	}
}
