package server_test

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

// pooledBroker starts a namespace broker whose default template keeps size sandboxes warm, with
// the template's setup (if any), and waits until the pool is full.
func pooledBroker(t *testing.T, size int, setup string, opts servertest.Options) *servertest.Broker {
	t.Helper()
	if opts.Provider == "" {
		opts.Provider = "namespace"
	}
	opts.Templates = map[string]provider.Template{"default": {Name: "default", Setup: setup, Pool: provider.Pool{Size: size}}}
	b := servertest.New(t, opts)
	waitPool(t, b, size)
	return b
}

// poolStat is the default template's pool on b.
func poolStat(b *servertest.Broker) sandbox.PoolStat {
	for _, s := range b.Manager.PoolStats() {
		if s.Template == "default" {
			return s
		}
	}
	return sandbox.PoolStat{}
}

func waitPool(t *testing.T, b *servertest.Broker, ready int) {
	t.Helper()
	wait.Eventually(t, 60*time.Second, func() bool { return poolStat(b).Ready == ready }, "the pool holds %d ready sandboxes (it has %+v)", ready, poolStat(b))
}

// sandboxDirs lists the sandbox ids with files on b's data dir: pooled and org sandboxes alike.
func sandboxDirs(t *testing.T, b *servertest.Broker) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(b.DataDir, "sandboxes"))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "sb_") {
			ids = append(ids, e.Name())
		}
	}
	return ids
}

// poolUIDOwners counts the uids held under the pool's owner.
func poolUIDOwners(t *testing.T, b *servertest.Broker) int {
	t.Helper()
	all, err := b.RDB.HGetAll(t.Context(), "sbx:{uids}:owners").Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, owner := range all {
		if strings.HasPrefix(owner, store.PoolOrg+"/") {
			n++
		}
	}
	return n
}

// A create claims a pooled sandbox: running at once, the template's setup already run, a workspace
// that is empty and a host uid of its own (moved from the pool to the org), counted and listed as
// the org's; the pool is refilled, and pooled sandboxes are in no org's list but in /metrics and
// /readyz.
func TestPoolClaim(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := t.Context()
	uids := store.UIDRange{First: 232000, Last: 232999}
	b := pooledBroker(t, 2, "echo warmed > ~/.setup-ran", servertest.Options{SandboxUIDs: &uids})
	if poolUIDOwners(t, b) != 2 {
		t.Fatalf("%d uids held by the pool, want 2", poolUIDOwners(t, b))
	}
	list, err := b.Client.ListSandboxes(ctx, clientList())
	if err != nil || len(list.Items) != 0 {
		t.Fatalf("an org lists pooled sandboxes: %+v, %v", list.Items, err)
	}
	pooled := sandboxDirs(t, b)
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"})
	if err != nil {
		t.Fatal(err)
	}
	sb := res.Sandbox
	if res.Outcome != protocol.OutcomeCreated || sb.Status != protocol.StatusRunning {
		t.Fatalf("create from the pool: %s, %s", res.Outcome, sb.Status)
	}
	if !contains(pooled, sb.ID) {
		t.Fatalf("sandbox %s was not one of the pooled %v", sb.ID, pooled)
	}
	if s := poolStat(b); s.Claims != 1 || s.Misses != 0 {
		t.Fatalf("pool after one create: %+v, want one claim", s)
	}
	if got := run(t, b, sb.ID, "cat ~/.setup-ran"); got != "warmed" {
		t.Fatalf("the template's setup had not run: %q", got)
	}
	if got := run(t, b, sb.ID, "ls -A /workspace; id -u"); got != "1000" {
		t.Fatalf("a claimed sandbox's workspace is not empty or its user not 1000: %q", got)
	}
	uid := recordUID(t, b, sb.ID)
	if owner, _ := b.Store.UIDOwner(ctx, uid); owner != b.Org+"/"+sb.ID {
		t.Fatalf("uid %d belongs to %q, want the org's sandbox", uid, owner)
	}
	ws := filepath.Join(b.DataDir, "sandboxes", sb.ID, "workspace")
	if got := ownerOf(t, ws); got != uid {
		t.Fatalf("workspace owned by %d, want the sandbox's uid %d", got, uid)
	}
	// A file the org writes is its own, exec and files alike.
	if _, err := b.Client.Delegate(ctx, "warm", protocol.MintRequest{Scopes: protocol.Scopes}); err != nil {
		t.Fatal(err)
	}
	// Refilled in the background, with a new sandbox and a new uid.
	waitPool(t, b, 2)
	if poolUIDOwners(t, b) != 2 {
		t.Fatalf("%d uids held by the pool after the refill, want 2", poolUIDOwners(t, b))
	}
	list, err = b.Client.ListSandboxes(ctx, clientList())
	if err != nil || len(list.Items) != 1 || list.Items[0].ID != sb.ID {
		t.Fatalf("the org's list: %+v, %v; want only %s", list.Items, err, sb.ID)
	}
	for _, path := range []string{"/metrics", "/readyz"} {
		body := getBody(t, b.URL+path)
		want := map[string]string{"/metrics": `sbx_pool_ready{template="default"} 2`, "/readyz": `"pool":[{"template":"default","size":2,"ready":2`}[path]
		if !strings.Contains(body, want) {
			t.Errorf("%s does not show the pool (%q):\n%s", path, want, body)
		}
	}
	// Deleted, it is gone for good: the pool never takes back what an org had.
	if _, err := b.Client.DeleteSandbox(ctx, "warm"); err != nil {
		t.Fatal(err)
	}
	if owner, _ := b.Store.UIDOwner(ctx, uid); owner != "" {
		t.Fatalf("uid %d still held by %q after delete", uid, owner)
	}
	if contains(sandboxDirs(t, b), sb.ID) {
		t.Fatal("a deleted claimed sandbox's files stayed")
	}
	wait.Never(t, 200*time.Millisecond, func() bool { return poolStat(b).Ready != 2 }, "the pool changed after a delete")
}

// Creates racing on one name get one sandbox; the pooled sandboxes the losers took go back to the
// pool untouched, so nothing is started for them and nothing leaks. Both providers pool alike.
func TestPoolConcurrentSameName(t *testing.T) {
	needRoot(t)
	t.Parallel()
	for _, prov := range []string{"namespace", "dir"} {
		t.Run(prov, func(t *testing.T) {
			t.Parallel()
			testPoolConcurrentSameName(t, prov)
		})
	}
}

func testPoolConcurrentSameName(t *testing.T, prov string) {
	ctx := t.Context()
	b := pooledBroker(t, 4, "", servertest.Options{Provider: prov})
	const n = 8
	ids := make(chan string, n)
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "same"})
			if err != nil {
				t.Error(err)
				return
			}
			ids <- res.Sandbox.ID
		}()
	}
	wg.Wait()
	close(ids)
	one := ""
	for id := range ids {
		if one == "" {
			one = id
		}
		if id != one {
			t.Fatalf("one name, two sandboxes: %s and %s", one, id)
		}
	}
	list, err := b.Client.ListSandboxes(ctx, clientList())
	if err != nil || len(list.Items) != 1 {
		t.Fatalf("the org has %d sandboxes (%v), want 1", len(list.Items), err)
	}
	waitPool(t, b, 4)
	if dirs := sandboxDirs(t, b); len(dirs) != 5 {
		t.Fatalf("%d sandboxes on disk, want the claimed one and 4 pooled: %v", len(dirs), dirs)
	}
	if s := poolStat(b); s.FillErrors != 0 {
		t.Fatalf("pool %+v", s)
	}
	// A create refused for the name (no reuse) gives its pooled sandbox back as well.
	noReuse := false
	before := poolStat(b)
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "same", Reuse: &noReuse}); code(err) != protocol.CodeNameConflict {
		t.Fatalf("a create of a taken name without reuse: %v, want name_conflict", err)
	}
	if after := poolStat(b); after.Ready != 4 || after.Claims != before.Claims {
		t.Fatalf("pool %+v after a refused name (before %+v)", after, before)
	}
	if got := run(t, b, one, "echo ok"); got != "ok" {
		t.Fatalf("the one sandbox: %q", got)
	}
}

// Two brokers on one Redis, each with its own pool, never hand out one sandbox twice: distinct
// ids, uids and nodes for distinct names, and one sandbox for one name created on both at once.
func TestPoolTwoBrokers(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := t.Context()
	uids := store.UIDRange{First: 233000, Last: 233999}
	b1 := pooledBroker(t, 3, "", servertest.Options{SandboxUIDs: &uids})
	b2 := pooledBroker(t, 3, "", servertest.Options{SandboxUIDs: &uids, Redis: b1.Redis, Node: "node-2"})
	b2.Org = b1.Org
	b2.Client = b2.NewClient(b1.Org)
	type got struct{ id, name string }
	out := make(chan got, 8)
	var wg sync.WaitGroup
	for i := range 6 {
		b := []*servertest.Broker{b1, b2}[i%2]
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("n%d", i)
			res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name})
			if err != nil {
				t.Error(err)
				return
			}
			out <- got{res.Sandbox.ID, name}
		}()
	}
	for _, b := range []*servertest.Broker{b1, b2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "shared"})
			if err != nil {
				t.Error(err)
				return
			}
			out <- got{res.Sandbox.ID, "shared"}
		}()
	}
	wg.Wait()
	close(out)
	byID := map[string]string{}
	shared := map[string]bool{}
	for g := range out {
		if g.name == "shared" {
			shared[g.id] = true
			continue
		}
		if prev, dup := byID[g.id]; dup {
			t.Fatalf("sandbox %s handed out for %s and %s", g.id, prev, g.name)
		}
		byID[g.id] = g.name
	}
	if len(shared) != 1 {
		t.Fatalf("one name created on two brokers gave %d sandboxes", len(shared))
	}
	seenUID := map[int]string{}
	for id := range byID {
		rec, err := b1.Store.Get(ctx, b1.Org, id)
		if err != nil {
			t.Fatal(err)
		}
		local := map[string]*servertest.Broker{"node-test": b1, "node-2": b2}[rec.Node]
		if local == nil || !contains(sandboxDirs(t, local), id) {
			t.Fatalf("sandbox %s recorded on %q is not hosted there", id, rec.Node)
		}
		if prev, dup := seenUID[rec.UID]; dup {
			t.Fatalf("uid %d held by %s and %s", rec.UID, prev, id)
		}
		seenUID[rec.UID] = id
	}
	waitPool(t, b1, 3)
	waitPool(t, b2, 3)
}

// A claimed sandbox counts in the org's quota; a create the quota refuses gives its pooled
// sandbox back (nothing is started for it, the org has nothing more).
func TestPoolQuota(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := t.Context()
	b := pooledBroker(t, 2, "", servertest.Options{Limits: store.Limits{MaxSandboxes: 1}})
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "one"}); err != nil {
		t.Fatal(err)
	}
	waitPool(t, b, 2)
	before := poolStat(b)
	_, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "two"})
	if code(err) != protocol.CodeQuotaExceeded {
		t.Fatalf("a second sandbox past max_sandboxes 1: %v, want quota_exceeded", err)
	}
	after := poolStat(b)
	if after.Ready != 2 || after.Claims != before.Claims {
		t.Fatalf("pool %+v after a refused claim (before %+v): the sandbox did not come back", after, before)
	}
	if dirs := sandboxDirs(t, b); len(dirs) != 3 {
		t.Fatalf("%d sandboxes on disk, want 3", len(dirs))
	}
	if _, err := b.Client.DeleteSandbox(ctx, "one"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "two"}); err != nil {
		t.Fatalf("a create within the quota again: %v", err)
	}
}

// Faults: a sandbox whose processes die while pooled is never handed out; a Redis outage during a
// claim fails that create and loses nothing (no sandbox, no uid, no files left); a template whose
// setup fails fills nothing and never hands out a broken sandbox.
func TestPoolFaults(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := t.Context()
	t.Run("killed while pooled", func(t *testing.T) {
		t.Parallel()
		b := pooledBroker(t, 2, "", servertest.Options{})
		for _, id := range sandboxDirs(t, b) {
			killCgroup(t, id)
		}
		res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "after-kill"})
		if err != nil {
			t.Fatal(err)
		}
		if got := run(t, b, res.Sandbox.ID, "echo alive"); got != "alive" {
			t.Fatalf("a sandbox created after its pool was killed: %q", got)
		}
		waitPool(t, b, 2)
		wait.Eventually(t, 10*time.Second, func() bool { return len(sandboxDirs(t, b)) == 3 }, "the killed pooled sandboxes are removed")
	})
	t.Run("redis outage during a claim", func(t *testing.T) {
		t.Parallel()
		uids := store.UIDRange{First: 234000, Last: 234999}
		b := pooledBroker(t, 2, "", servertest.Options{SandboxUIDs: &uids, RedisTimeout: 300 * time.Millisecond})
		b.Redis.Pause()
		_, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "blink"})
		b.Redis.Continue()
		if err == nil {
			t.Fatal("a create with Redis hung succeeded")
		}
		res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "blink"})
		if err != nil {
			t.Fatal(err)
		}
		if got := run(t, b, res.Sandbox.ID, "ls -A /workspace; echo ok"); got != "ok" {
			t.Fatalf("the sandbox after the outage: %q", got)
		}
		waitPool(t, b, 2)
		wait.Eventually(t, 10*time.Second, func() bool {
			return len(sandboxDirs(t, b)) == 3 && poolUIDOwners(t, b) == 2
		}, "what the cut claim took is returned or removed (dirs %v, pool uids %d)", sandboxDirs(t, b), poolUIDOwners(t, b))
		owners, _ := b.RDB.HLen(ctx, "sbx:{uids}:owners").Result()
		if owners != 3 {
			t.Fatalf("%d uids held, want 3 (one sandbox, two pooled)", owners)
		}
	})
	t.Run("setup fails", func(t *testing.T) {
		t.Parallel()
		opts := servertest.Options{Provider: "namespace",
			Templates: map[string]provider.Template{"default": {Name: "default", Setup: "exit 3", Pool: provider.Pool{Size: 1}}}}
		b := servertest.New(t, opts)
		wait.Eventually(t, 30*time.Second, func() bool { return poolStat(b).FillErrors > 0 }, "a failed fill is counted")
		if s := poolStat(b); s.Ready != 0 {
			t.Fatalf("pool %+v holds a sandbox whose setup failed", s)
		}
		_, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "broken"})
		if code(err) != protocol.CodeSandboxFailed {
			t.Fatalf("create with a failing setup: %v, want sandbox_failed", err)
		}
		wait.Eventually(t, 10*time.Second, func() bool { return len(sandboxDirs(t, b)) == 1 }, "failed pool fills leave no files (dirs %v)", sandboxDirs(t, b))
	})
}

// Stopping the broker destroys its pooled sandboxes (files, uids, index entries); a pooled
// sandbox a crash left behind is destroyed at the next start, and one whose claim reached the
// store is recovered as its org's.
func TestPoolStopAndRecover(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := t.Context()
	uids := store.UIDRange{First: 235000, Last: 235999}
	b := pooledBroker(t, 2, "", servertest.Options{SandboxUIDs: &uids})
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "kept"}); err != nil {
		t.Fatal(err)
	}
	waitPool(t, b, 2)
	b.Stop()
	if dirs := sandboxDirs(t, b); len(dirs) != 1 {
		t.Fatalf("after a stop, %d sandboxes on disk, want the org's only: %v", len(dirs), dirs)
	}
	if n := poolUIDOwners(t, b); n != 0 {
		t.Fatalf("after a stop, the pool still holds %d uids", n)
	}
	// A crash's leftovers: a pooled sandbox's files, uid and index entry, and a claim cut after
	// its record was made.
	prov, err := provider.NewNamespace(provider.Config{DataDir: b.DataDir})
	if err != nil {
		t.Fatal(err)
	}
	left, claimed := protocol.NewSandboxID(), protocol.NewSandboxID()
	for _, id := range []string{left, claimed} {
		if err := prov.Create(ctx, provider.Spec{ID: id, Template: provider.DefaultTemplate()}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.Store.AllocateUID(ctx, uids, store.PoolOrg, left); err != nil {
		t.Fatal(err)
	}
	writeIndex(t, b, left, store.PoolOrg+"\ndefault")
	writeIndex(t, b, claimed, store.PoolOrg+"\ndefault\n"+b.Org)
	rec := store.Record{ID: claimed, Org: b.Org, Name: "cut", Template: "default", Provider: "namespace", Node: "node-test",
		Status: protocol.StatusProvisioning, TTL: time.Hour, CreatedAt: time.Now(), Heartbeat: time.Now()}
	if _, _, err := b.Store.CreateOrReuse(ctx, rec, false); err != nil {
		t.Fatal(err)
	}
	b2 := servertest.New(t, servertest.Options{Provider: "namespace", Redis: b.Redis, DataDir: b.DataDir, SandboxUIDs: &uids})
	if contains(sandboxDirs(t, b2), left) {
		t.Fatal("a pooled sandbox left by a crash was not removed at start")
	}
	if n := poolUIDOwners(t, b2); n != 0 {
		t.Fatalf("a crashed pool's uid is still held (%d)", n)
	}
	if _, err := os.Stat(filepath.Join(b.DataDir, "hosted", left)); !os.IsNotExist(err) {
		t.Fatalf("its index entry: %v", err)
	}
	c := b2.NewClient(b.Org)
	got, err := c.GetSandbox(ctx, "cut")
	if err != nil || got.Status != protocol.StatusFailed {
		t.Fatalf("a claim cut after its record: %+v, %v; want it failed like any create cut short", got, err)
	}
	if org, _ := os.ReadFile(filepath.Join(b.DataDir, "hosted", claimed)); string(org) != b.Org {
		t.Fatalf("its index entry says %q, want the org", org)
	}
	if got, err := c.GetSandbox(ctx, "kept"); err != nil || got.Status != protocol.StatusRunning {
		t.Fatalf("the org's sandbox after the restart: %+v, %v", got, err)
	}
}

func writeIndex(t *testing.T, b *servertest.Broker, id, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(b.DataDir, "hosted", id), []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// killCgroup kills every process of a namespace sandbox from the host, as the OOM killer or an
// operator would.
func killCgroup(t *testing.T, id string) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/pids", provider.DefaultCgroupParent, id, "cgroup.procs"))
	if err != nil {
		t.Fatalf("the pids cgroup of %s: %v", id, err)
	}
	var pids []int
	for _, f := range strings.Fields(string(raw)) {
		var pid int
		fmt.Sscan(f, &pid)
		syscall.Kill(pid, syscall.SIGKILL)
		pids = append(pids, pid)
	}
	// Until each has died, every thread of it (a zombie, or reaped): the broker may not have
	// noticed yet.
	wait.Eventually(t, 10*time.Second, func() bool {
		for _, pid := range pids {
			tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
			for _, task := range tasks {
				stat, err := os.ReadFile(task)
				if err != nil {
					continue
				}
				s := string(stat)
				if st := s[strings.LastIndexByte(s, ')')+2]; st != 'Z' && st != 'X' {
					return false
				}
			}
		}
		return true
	}, "the processes of %s die", id)
}

func clientList() client.ListOptions { return client.ListOptions{} }

func getBody(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
