package server_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// tempFiles lists the upload temporary files under dir (the workspace's ".sbx-tmp-" names).
func tempFiles(t testing.TB, dir string) []string {
	t.Helper()
	var found []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), ".sbx-tmp-") {
			found = append(found, p)
		}
		return nil
	})
	return found
}

// An upload cut by a hang-up mid-stream: while it runs, its temporary file is in no ls, glob or
// grep answer, and after the hang-up it is gone from disk.
func TestDataplaneInterruptedUploadLeavesNothing(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "upload-cut")
	ws := workspaceDir(b, id)
	key := b.Client.APIKey()
	if err := os.MkdirAll(filepath.Join(ws, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}

	up := dialRaw(t, url, key)
	up.sendJSON(protocol.Request{ID: 1, Op: "upload", Args: map[string]any{"path": "sub/big.txt"}})
	up.sendBinary(dataFrame(protocol.FrameData, 1, bytes.Repeat([]byte("needle\n"), 100000)))
	if !wait.Until(10*time.Second, func() bool {
		for _, p := range tempFiles(t, ws) {
			if fi, err := os.Stat(p); err == nil && fi.Size() == 700000 {
				return true
			}
		}
		return false
	}) {
		t.Fatalf("the upload's temporary file never held the first frame: %v", tempFiles(t, ws))
	}

	c := dialRaw(t, url, key)
	for i, q := range []struct {
		op   string
		args any
	}{
		{"ls", map[string]any{"path": "sub"}},
		{"glob", map[string]any{"pattern": "**"}},
		{"glob", map[string]any{"pattern": "sub/.*"}},
		{"grep", map[string]any{"pattern": "needle"}},
	} {
		got := c.call(uint32(10+i), q.op, q.args)
		if got.Error != nil {
			t.Fatalf("%s %v: %s", q.op, q.args, got)
		}
		if strings.Contains(string(got.Result), ".sbx-tmp-") {
			t.Errorf("%s %v lists the upload's temporary file: %.300s", q.op, q.args, got.Result)
		}
	}

	// The agent's process dies: the socket closes with no close frame and no cancel.
	up.ws.NetConn().Close()
	if !wait.Until(10*time.Second, func() bool { return len(tempFiles(t, ws)) == 0 }) {
		t.Errorf("temporary files left after the hang-up: %v", tempFiles(t, ws))
	}
	if _, err := os.Lstat(filepath.Join(ws, "sub", "big.txt")); !os.IsNotExist(err) {
		t.Errorf("the cut upload's target exists: %v", err)
	}
}

// Temporary files a dead broker left (it could not remove them) are swept when the sandbox
// starts again; a tenant's own file with a similar name stays.
func TestStaleUploadTempsSweptAtStart(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, _ := newSandbox(t, b, "sweep")
	ws := workspaceDir(b, id)
	ctx := context.Background()
	if _, err := b.Client.StopSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	stale := []string{".sbx-tmp-0123456789abcdef", "a/b/.sbx-tmp-fedcba9876543210"}
	keep := []string{".sbx-tmp-notes", "a/keep.txt"}
	for _, p := range append(stale, keep...) {
		full := filepath.Join(ws, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.Client.ResumeSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	for _, p := range stale {
		if _, err := os.Lstat(filepath.Join(ws, p)); !os.IsNotExist(err) {
			t.Errorf("stale temporary file %s survived the start: %v", p, err)
		}
	}
	for _, p := range keep {
		if _, err := os.Lstat(filepath.Join(ws, p)); err != nil {
			t.Errorf("%s was removed: %v", p, err)
		}
	}
}

// fdsUnder counts this process's open descriptors on files under the data dir dir, but for the
// image pool's and the base images' (disk-images/): the pool copies an image ahead in the
// background after each create, which a count taken meanwhile would find, and none is a sandbox's.
func fdsUnder(t testing.TB, dir string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	images := filepath.Join(dir, "disk-images") + "/"
	n := 0
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err == nil && strings.HasPrefix(target, dir+"/") && !strings.HasPrefix(target, images) {
			t.Logf("open under the data dir: %s", target)
			n++
		}
	}
	return n
}

// A stopped sandbox holds no descriptor, whether or not its files were used while it ran or
// after it stopped; resuming it and using its files opens what they need again.
func TestStoppedSandboxesHoldNoDescriptors(t *testing.T) {
	// Not parallel: it counts the whole process's descriptors.
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	ctx := context.Background()
	const n = 20
	var ids []string
	for i := 0; i < n; i++ {
		id, url := newSandbox(t, b, fmt.Sprintf("fd-%d", i))
		ids = append(ids, id)
		c := dialRaw(t, url, b.Client.APIKey())
		if got := c.call(1, "write", map[string]any{"path": "a.txt", "content": "x"}); got.Error != nil {
			t.Fatalf("write: %s", got)
		}
		c.ws.Close()
		if _, err := b.Client.StopSandbox(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if got := fdsUnder(t, b.DataDir); got != 0 {
		t.Errorf("%d stopped sandboxes hold %d descriptors under the data dir", n, got)
	}
	// A stopped sandbox's files can still be listed, and that holds nothing once it is stopped again.
	res, err := b.Client.ResumeSandbox(ctx, ids[0])
	if err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, dataplaneURL(b, res.ID), b.Client.APIKey())
	if got := c.call(1, "read", map[string]any{"path": "a.txt"}); got.Error != nil || !strings.Contains(string(got.Result), `"x"`) {
		t.Fatalf("read after resume: %s", got)
	}
	c.ws.Close()
	if _, err := b.Client.StopSandbox(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	if got := fdsUnder(t, b.DataDir); got != 0 {
		t.Errorf("after a resume, a read and a stop: %d descriptors under the data dir", got)
	}
}

// sandboxCgroups lists the cgroup directories of sandbox id under the broker's default cgroup
// parent, in every hierarchy.
func sandboxCgroups(id string) []string {
	found, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", provider.DefaultCgroupParent, id))
	more, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", provider.DefaultCgroupParent, id))
	return append(found, more...)
}

// The cgroups of a sandbox whose setup fails, of one that is stopped and of one that is deleted
// are gone.
func TestSandboxCgroupsRemoved(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace", Templates: map[string]provider.Template{
		"default": provider.DefaultTemplate(),
		"broken":  {Name: "broken", Setup: "exit 7"},
	}})
	if l, ok := b.Manager.Provider().(interface{ LimitsEnforced() (bool, string) }); !ok {
		t.Fatal("the namespace provider reports no limits")
	} else if ok, why := l.LimitsEnforced(); !ok {
		t.Fatalf("this test needs cgroups: %s", why)
	}
	ctx := context.Background()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "broken", Template: "broken"})
	if err == nil {
		t.Fatalf("a sandbox whose setup exits 7 was created: %+v", res)
	}
	list, err := b.Client.ListSandboxes(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var failedID string
	for _, s := range list.Items {
		if s.Name == "broken" {
			failedID = s.ID
		}
	}
	if failedID == "" {
		t.Fatal("no record of the failed sandbox")
	}
	if left := sandboxCgroups(failedID); len(left) > 0 {
		t.Errorf("cgroups of a failed sandbox: %v", left)
	}

	id, _ := newSandbox(t, b, "deleted")
	if len(sandboxCgroups(id)) == 0 {
		t.Fatal("a running sandbox has no cgroup (is the cgroup parent the default?)")
	}
	if _, err := b.Client.StopSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	if left := sandboxCgroups(id); len(left) > 0 {
		t.Errorf("cgroups of a stopped sandbox: %v", left)
	}
	if _, err := b.Client.ResumeSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.DeleteSandbox(ctx, id); err != nil {
		t.Fatal(err)
	}
	if !wait.Until(10*time.Second, func() bool { return len(sandboxCgroups(id)) == 0 }) {
		t.Errorf("cgroups of a deleted sandbox: %v", sandboxCgroups(id))
	}
}
