package server_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
	"github.com/sbxbroker/broker/tests/wait"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("sandboxes get their own host uid only under a root broker")
	}
}

// runtimeOf is the runtime of sandbox id of b's org, hosted by b.
func runtimeOf(t *testing.T, b *servertest.Broker, id string) provider.Instance {
	t.Helper()
	rec, err := b.Store.Get(t.Context(), b.Org, id)
	if err != nil {
		t.Fatal(err)
	}
	inst, err := b.Manager.Instance(rec)
	if err != nil {
		t.Fatalf("sandbox %s, record %s: runtime: %v", id, rec.Status, err)
	}
	return inst
}

// run runs a shell command in a sandbox hosted by b and returns its output.
func run(t *testing.T, b *servertest.Broker, id, cmd string) string {
	t.Helper()
	var out bytes.Buffer
	res, err := runtimeOf(t, b, id).Exec(t.Context(), provider.ExecRequest{Command: cmd, Stdout: &out})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%s: exit %d, %v: %s", cmd, res.ExitCode, err, out.String())
	}
	return strings.TrimSpace(out.String())
}

func recordUID(t *testing.T, b *servertest.Broker, id string) int {
	t.Helper()
	rec, err := b.Store.Get(t.Context(), b.Org, id)
	if err != nil {
		t.Fatal(err)
	}
	return rec.UID
}

func ownerOf(t *testing.T, p string) int {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return int(st.Uid)
}

// Every sandbox gets its own host uid from the range, atomically across two brokers on one Redis;
// it keeps it across stop, resume and a broker restart, and gives it back on delete.
func TestSandboxUIDs(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := context.Background()
	uids := store.UIDRange{First: 231000, Last: 231999}
	b1 := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids})
	b2 := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids, Redis: b1.Redis, Node: "node-2"})
	b2.Org = b1.Org
	b2.Client = b2.NewClient(b1.Org)

	seen := map[int]string{}
	var ids []string
	for i, b := range []*servertest.Broker{b1, b1, b2, b2} {
		res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "u" + string(rune('a'+i))})
		if err != nil {
			t.Fatal(err)
		}
		id := res.Sandbox.ID
		uid := recordUID(t, b, id)
		if uid < uids.First || uid > uids.Last {
			t.Fatalf("%s: uid %d, want one of %d-%d", id, uid, uids.First, uids.Last)
		}
		if other, dup := seen[uid]; dup {
			t.Fatalf("uid %d handed to %s and %s", uid, other, id)
		}
		seen[uid] = id
		ids = append(ids, id)
		if got := run(t, b, id, "id -u; stat -c %u /workspace"); got != "1000\n1000" {
			t.Errorf("%s: inside: %q, want uid 1000 owning /workspace", id, got)
		}
		if got := ownerOf(t, b.Manager.Provider().WorkspaceDir(provider.Spec{ID: id})); got != uid {
			t.Errorf("%s: workspace belongs to host uid %d, want its own %d", id, got, uid)
		}
		// What the broker creates in a workspace (a dataplane mkdir, write, upload) is the
		// sandbox's own too.
		rec, err := b.Store.Get(ctx, b.Org, id)
		if err != nil {
			t.Fatal(err)
		}
		ws, err := b.Manager.Workspace(rec)
		if err != nil {
			t.Fatal(err)
		}
		if err := ws.Mkdir(protocol.MkdirArgs{Path: "/workspace/by-broker"}); err != nil {
			t.Fatal(err)
		}
		if got := ownerOf(t, b.Manager.Provider().WorkspaceDir(provider.Spec{ID: id})+"/by-broker"); got != uid {
			t.Errorf("%s: a directory the broker made belongs to %d, want %d", id, got, uid)
		}
	}

	// Kept across stop and resume, and across a broker restart.
	id, uid := ids[0], recordUID(t, b1, ids[0])
	if _, err := b1.Client.StopSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	b1.Stop()
	b1 = servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids, Redis: b1.Redis, DataDir: b1.DataDir})
	if _, err := b1.Client.ResumeSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	if got := recordUID(t, b1, id); got != uid {
		t.Fatalf("uid after stop, restart and resume: %d, want %d", got, uid)
	}
	run(t, b1, id, "touch /workspace/after-resume")

	// Released on delete, and not the next one handed out.
	if _, err := b1.Client.DeleteSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	if owner, err := b1.Store.UIDOwner(ctx, uid); err != nil || owner != "" {
		t.Fatalf("uid %d after delete: owner %q, %v; want free", uid, owner, err)
	}
	res, err := b1.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "after-delete"})
	if err != nil {
		t.Fatal(err)
	}
	if got := recordUID(t, b1, res.Sandbox.ID); got == uid {
		t.Errorf("the deleted sandbox's uid %d was handed out again at once", uid)
	}
}

// A full range refuses a create with capacity_exhausted and a message that says what to do, and
// leaves nothing behind; a reuse of an existing sandbox still works.
func TestSandboxUIDsExhausted(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := context.Background()
	uids := store.UIDRange{First: 232000, Last: 232000}
	b := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids})
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "one"}); err != nil {
		t.Fatal(err)
	}
	_, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "two"})
	var ae *protocol.Error
	if !errors.As(err, &ae) || ae.Status != 503 || ae.Code != protocol.CodeCapacity || !strings.Contains(ae.Message, "--sandbox-uids") {
		t.Fatalf("create with the range full: %v, want 503 %s naming --sandbox-uids", err, protocol.CodeCapacity)
	}
	list, err := b.Client.ListAllSandboxes(ctx, client.ListOptions{})
	if err != nil || len(list) != 1 {
		t.Fatalf("after a refused create: %d sandboxes, %v; want 1", len(list), err)
	}
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "one"}); err != nil {
		t.Fatalf("reuse with the range full: %v", err)
	}
}

// A sandbox recorded before each got its own uid (it ran as the shared one) gets its own at its next
// start, and its files with it.
func TestSandboxUIDMigration(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := context.Background()
	none := store.UIDRange{}
	old := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &none})
	res, err := old.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "legacy"})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Sandbox.ID
	run(t, old, id, "mkdir -p /workspace/d && echo kept > /workspace/d/f")
	if uid := recordUID(t, old, id); uid != 0 {
		t.Fatalf("a broker without a range recorded uid %d", uid)
	}
	if _, err := old.Client.StopSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	old.Stop()

	uids := store.UIDRange{First: 233000, Last: 233099}
	b := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids, Redis: old.Redis, DataDir: old.DataDir})
	if _, err := b.Client.ResumeSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	uid := recordUID(t, b, id)
	if uid < uids.First || uid > uids.Last {
		t.Fatalf("uid after the upgrade: %d, want one of %d-%d", uid, uids.First, uids.Last)
	}
	ws := b.Manager.Provider().WorkspaceDir(provider.Spec{ID: id})
	for _, p := range []string{ws, ws + "/d", ws + "/d/f"} {
		if got := ownerOf(t, p); got != uid {
			t.Errorf("%s belongs to %d, want the sandbox's own %d", p, got, uid)
		}
	}
	if got := run(t, b, id, "echo more >> /workspace/d/f && cat /workspace/d/f"); got != "kept\nmore" {
		t.Errorf("the old file inside: %q", got)
	}
}

// A Redis that lost everything (flushed) loses the uid table with the records; the broker keeps
// the files of sandboxes it hosts, and now the uid they belong to as well, so that no new sandbox
// is given it and with it those files.
func TestSandboxUIDKeptForFilesAfterFlush(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := context.Background()
	uids := store.UIDRange{First: 234000, Last: 234001}
	b := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids})
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "kept"})
	if err != nil {
		t.Fatal(err)
	}
	id, uid := res.Sandbox.ID, recordUID(t, b, res.Sandbox.ID)
	b.Stop()
	if err := b.RDB.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	b2 := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids, Redis: b.Redis, DataDir: b.DataDir})
	if owner, err := b2.Store.UIDOwner(ctx, uid); err != nil || owner != b.Org+"/"+id {
		t.Fatalf("uid %d of the kept files after a flush and a restart: owner %q, %v; want %s/%s", uid, owner, err, b.Org, id)
	}
	res, err = b2.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "new"})
	if err != nil {
		t.Fatal(err)
	}
	if got := recordUID(t, b2, res.Sandbox.ID); got == uid {
		t.Fatalf("a new sandbox got uid %d, which the kept files of %s belong to", uid, id)
	}
}

// A Redis that loses everything (flushed, or an empty replica taking over) while a sandbox runs:
// until the reconcile finds its record gone, a create is handed uids from an empty table, the
// running sandbox's first among them. Two sandboxes would run as one host uid (signals, /proc,
// keyrings). The broker refuses a uid a sandbox it hosts runs as, gives it back to that sandbox in
// the table, and draws another.
func TestSandboxUIDOfARunningSandboxNotReusedAfterFlush(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := context.Background()
	uids := store.UIDRange{First: 235000, Last: 235003}
	b := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids})
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "running"})
	if err != nil {
		t.Fatal(err)
	}
	id, uid := res.Sandbox.ID, recordUID(t, b, res.Sandbox.ID)
	if err := b.RDB.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	// Straight to the manager: the flush took the API keys too.
	rec, _, err := b.Manager.Create(ctx, sandbox.Caller{Org: b.Org, Actor: "test"}, sandbox.CreateRequest{Name: "new"})
	if err != nil {
		t.Fatal(err)
	}
	if rec.UID == uid {
		t.Fatalf("a new sandbox got uid %d, which running sandbox %s runs as", uid, id)
	}
	if owner, err := b.Store.UIDOwner(ctx, uid); err != nil || owner != b.Org+"/"+id {
		t.Fatalf("uid %d after the refusal: owner %q, %v; want %s/%s", uid, owner, err, b.Org, id)
	}
}

// The same for a sandbox waiting in the warm pool: a create after the flush is not given its uid.
func TestSandboxUIDOfAPooledSandboxNotReusedAfterFlush(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := context.Background()
	uids := store.UIDRange{First: 236000, Last: 236003}
	b := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids, Templates: map[string]provider.Template{
		"default": {Name: "default", Pool: provider.Pool{Size: 1}},
		"plain":   {Name: "plain"},
	}})
	waitPool(t, b, 1)
	pooled := sandboxDirs(t, b)
	if len(pooled) != 1 {
		t.Fatalf("sandboxes on disk: %v; want the pooled one", pooled)
	}
	uid := ownerOf(t, filepath.Join(b.DataDir, "sandboxes", pooled[0], "workspace"))
	if err := b.RDB.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	rec, _, err := b.Manager.Create(ctx, sandbox.Caller{Org: b.Org, Actor: "test"}, sandbox.CreateRequest{Name: "new", Template: "plain"})
	if err != nil {
		t.Fatal(err)
	}
	if rec.UID == uid {
		t.Fatalf("a new sandbox got uid %d, which pooled sandbox %s runs as", uid, pooled[0])
	}
}

// The same while the pooled sandbox is still being made (its template's setup running): its uid
// was drawn and its processes run as it, but it is not in the pool's ready list yet. Before, only
// ready and left-over pooled sandboxes were checked, and a create in that window (the setup's
// length, a few ms to minutes) was given the uid.
func TestSandboxUIDOfAPooledSandboxBeingMadeNotReusedAfterFlush(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := context.Background()
	uids := store.UIDRange{First: 236100, Last: 236103}
	b := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids, Templates: map[string]provider.Template{
		// The setup waits until the test opens its FIFO for writing.
		"default": {Name: "default", Pool: provider.Pool{Size: 1}, Setup: "mkfifo gate && read x < gate"},
		"plain":   {Name: "plain"},
	}})
	var gate string
	wait.Eventually(t, 60*time.Second, func() bool {
		for _, id := range sandboxDirs(t, b) {
			p := filepath.Join(b.DataDir, "sandboxes", id, "workspace", "gate")
			if fi, err := os.Stat(p); err == nil && fi.Mode()&os.ModeNamedPipe != 0 {
				gate = p
				return true
			}
		}
		return false
	}, "the pooled sandbox's setup made its FIFO")
	if st := poolStat(b); st.Ready != 0 {
		t.Fatalf("the pool: %+v; want its sandbox still in its setup", st)
	}
	uid := ownerOf(t, filepath.Dir(gate))
	if err := b.RDB.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	rec, _, err := b.Manager.Create(ctx, sandbox.Caller{Org: b.Org, Actor: "test"}, sandbox.CreateRequest{Name: "new", Template: "plain"})
	if err != nil {
		t.Fatal(err)
	}
	// Let the setup end (its sandbox then enters the pool or is discarded, as the flush decides).
	f, err := os.OpenFile(gate, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("go\n")
	f.Close()
	if rec.UID == uid {
		t.Fatalf("a new sandbox got uid %d, which the pooled sandbox being made runs as", uid)
	}
}

// The same for an org's create between its uid's draw and its start: the uid is drawn before the
// record is written, and the create's Redis round trips come before its runtime exists. Redis
// loses everything in that window (here while the create script's answer is on its way), and a
// create of another org is handed the uids from an empty table, the first create's among them.
// Before, only sandboxes with a runtime (and pooled ones) were checked, and both sandboxes ran as
// one host uid.
func TestSandboxUIDOfACreateUnderWayNotReusedAfterFlush(t *testing.T) {
	needRoot(t)
	t.Parallel()
	ctx := context.Background()
	uids := store.UIDRange{First: 238000, Last: 238003}
	lossy := &redistest.LoseAnswers{Match: []byte("under-way")}
	b := servertest.New(t, servertest.Options{Provider: "namespace", SandboxUIDs: &uids, RedisDialer: lossy.Dial})
	var other store.Record
	var otherErr error
	lossy.Lost = func([]byte) {
		// The first create has drawn its uid and sent its record: Redis loses everything, and
		// another org's create runs to the end before the first's record is sent again.
		if err := b.RDB.FlushAll(ctx).Err(); err != nil {
			otherErr = err
			return
		}
		other, _, otherErr = b.Manager.Create(ctx, sandbox.Caller{Org: "other-org", Actor: "test"}, sandbox.CreateRequest{Name: "other"})
	}
	lossy.Lose.Store(1)
	rec, _, err := b.Manager.Create(ctx, sandbox.Caller{Org: b.Org, Actor: "test"}, sandbox.CreateRequest{Name: "under-way"})
	if err != nil {
		t.Fatal(err)
	}
	if lossy.Lose.Load() > 0 {
		t.Fatal("no answer was lost: the test did not test")
	}
	if otherErr != nil {
		t.Fatalf("the other org's create: %v", otherErr)
	}
	if rec.UID == 0 || other.UID == rec.UID {
		t.Fatalf("sandbox %s of %s and sandbox %s of other-org were both given uid %d", rec.ID, b.Org, other.ID, rec.UID)
	}
	if got := run(t, b, rec.ID, "id -u"); got != "1000" {
		t.Fatalf("the first sandbox inside: %q", got)
	}
}
