package tests

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/tests/wait"
)

// The foundation tour: create -> reuse -> list (table, json) -> get -> stop -> resume -> delete,
// with a broker restart in the middle that keeps the sandbox and a file in its workspace.
func TestLifecycleThroughSbctl(t *testing.T) {
	t.Parallel()
	b := startBroker(t)

	out := b.ok("create", "dev", "--ttl", "10m", "--tag", "thread_id=T1")
	if !strings.HasPrefix(out, "created sandbox dev (sb_") {
		t.Fatalf("create: %q", out)
	}
	var res protocol.CreateSandboxResponse
	if err := json.Unmarshal([]byte(b.ok("create", "dev", "-o", "json")), &res); err != nil || res.Outcome != "reused" {
		t.Fatalf("reuse: %v %+v", err, res)
	}
	id := res.Sandbox.ID

	table := b.ok("list")
	if !strings.Contains(table, "NAME") || !strings.Contains(table, id) || !strings.Contains(table, "thread_id=T1") {
		t.Fatalf("list table:\n%s", table)
	}
	var items []protocol.Sandbox
	if err := json.Unmarshal([]byte(b.ok("list", "-o", "json", "--tag", "thread_id=T1")), &items); err != nil || len(items) != 1 || items[0].ID != id {
		t.Fatalf("list json: %v %+v", err, items)
	}
	if got := b.ok("list", "--tag", "thread_id=nope", "-q"); got != "" {
		t.Fatalf("filtered list should be empty: %q", got)
	}
	if got := b.ok("get", "dev", "-o", "yaml"); !strings.Contains(got, "status: running") {
		t.Fatalf("get yaml:\n%s", got)
	}

	ws := filepath.Join(b.DataDir, "sandboxes", id, "workspace")
	if err := os.WriteFile(filepath.Join(ws, "notes.txt"), []byte("survives"), 0o644); err != nil {
		t.Fatal(err)
	}

	b.restart()
	if got := b.ok("get", id); !strings.Contains(got, "running") || !strings.Contains(got, "Processes lost") {
		t.Fatalf("after restart the sandbox must be running with its lost processes noted:\n%s", got)
	}
	if data, err := os.ReadFile(filepath.Join(ws, "notes.txt")); err != nil || string(data) != "survives" {
		t.Fatalf("workspace file after restart: %q %v", data, err)
	}

	if got := b.ok("stop", "dev"); !strings.Contains(got, "stopped sandbox dev: stopped (requested)") {
		t.Fatalf("stop: %q", got)
	}
	if r := b.sbctl("heartbeat", "dev"); r.code != 5 || !strings.Contains(r.stderr, "stopped") {
		t.Fatalf("heartbeat of a stopped sandbox: exit %d %q", r.code, r.stderr)
	}
	if got := b.ok("resume", "dev"); !strings.Contains(got, "resumed sandbox dev: running") {
		t.Fatalf("resume: %q", got)
	}
	if got := b.ok("extend", "dev", "--ttl", "2h"); !strings.Contains(got, "lease expires in 1h59m") && !strings.Contains(got, "lease expires in 2h0m0s") {
		t.Fatalf("extend: %q", got)
	}
	if got := b.ok("delete", "dev"); !strings.Contains(got, "deleted dev") {
		t.Fatalf("delete: %q", got)
	}
	if _, err := os.Stat(ws); !os.IsNotExist(err) {
		t.Fatalf("workspace left after delete: %v", err)
	}
	if r := b.sbctl("get", "dev"); r.code != 3 || !strings.Contains(r.stderr, "not found") {
		t.Fatalf("get after delete: exit %d %q", r.code, r.stderr)
	}
}

// Errors a person meets say what to do and exit with a code scripts can use.
func TestSbctlErrors(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"get"}, 2, "REF"},
		{[]string{"create", "Bad_Name"}, 2, "sandbox name"},
		{[]string{"create", "x", "--tag", "novalue"}, 2, "key=value"},
		{[]string{"list", "-o", "xml"}, 2, "table, json or yaml"},
		{[]string{"get", "nosuch"}, 3, "not found"},
		{[]string{"list", "--api-key", "sbk_aaaaaaaaaaaaaaaa_bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"}, 4, "API key"},
		{[]string{"list", "--broker", "http://127.0.0.1:1"}, 6, "cannot reach the broker"},
		{[]string{"delete", "--tag", "a=b"}, 0, "no sandbox matches"},
	} {
		r := b.sbctl(tc.args...)
		if r.code != tc.code || !strings.Contains(r.stderr+r.stdout, tc.want) {
			t.Errorf("sbctl %v: exit %d, stderr %q; want exit %d mentioning %q", tc.args, r.code, r.stderr, tc.code, tc.want)
		}
	}
	b.ok("create", "a1", "--tag", "batch=x")
	b.ok("create", "a2", "--tag", "batch=x")
	if r := b.sbctl("delete", "--tag", "batch=x"); r.code != 2 || !strings.Contains(r.stderr, "--yes") {
		t.Fatalf("batch delete without --yes on a non-terminal: %d %q", r.code, r.stderr)
	}
	if got := b.ok("delete", "--tag", "batch=x", "--dry-run"); strings.Count(got, "would delete") != 2 {
		t.Fatalf("dry run: %q", got)
	}
	if got := b.ok("delete", "--tag", "batch=x", "--yes", "-q"); strings.Count(got, "sb_") != 2 {
		t.Fatalf("batch delete: %q", got)
	}
}

// TestStoppedBrokerUnmountsItsImagePool: the disk images a broker mounts ahead for its next creates
// (the namespace provider's image pool, where disk quotas are enforced) belong to nobody; a broker
// stopped with SIGTERM unmounts and removes them, where it left them mounted until its next start
// (loop devices held, and a data dir that an operator's rm -r met mounts in).
func TestStoppedBrokerUnmountsItsImagePool(t *testing.T) {
	b := startBroker(t)
	b.ok("create", "pooled")
	pool := filepath.Join(b.DataDir, "disk-images", "pool")
	// The pool fills behind the first create: one image mounted, at least.
	wait.Eventually(t, 30*time.Second, func() bool { return len(mountsUnder(t, filepath.Join(pool, "mnt"))) > 1 },
		"the image pool filling: mounts under %s: %v", pool, mountsUnder(t, pool))
	b.stop()
	if left := mountsUnder(t, pool); len(left) > 0 {
		t.Fatalf("a stopped broker left its image pool mounted: %v\n%s", left, b.log)
	}
}

// mountsUnder lists the mount points under dir, dir included.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(line); len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			out = append(out, f[4])
		}
	}
	return out
}
