package server_test

// The broker-wide budget for what operations build in memory: the names a tar walk holds and an
// untar remembers, the names and answers of ls, glob, grep and changes. Each operation bounds its
// own, but without a budget shared by all of them one org's many requests on many connections add
// up to many GB of the broker's memory.

import (
	"archive/tar"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// wideTree makes dir/wide: a directory of 1,500 names of 150 bytes (about 250 KB of names, held by
// a tar walk while it is inside) whose first entry is a 64 MiB sparse file, so that a tar whose
// client does not read stops inside it, holding those names.
func wideTree(t *testing.T, dir string) {
	t.Helper()
	wide := filepath.Join(dir, "wide")
	must(t, os.Mkdir(wide, 0o755))
	f, err := os.Create(filepath.Join(wide, "a-big"))
	must(t, err)
	must(t, f.Truncate(64<<20))
	must(t, f.Close())
	for i := range 1500 {
		name := fmt.Sprintf("n%04d-", i)
		must(t, os.WriteFile(filepath.Join(wide, name+strings.Repeat("x", 150-len(name))), nil, 0o644))
	}
}

// firstFrame reads until the request id has a data frame (its tar is under way) or an answer.
func (c *rawConn) firstFrame(id uint32) (streaming bool, a answer) {
	c.t.Helper()
	for {
		if len(c.bins[id]) > 0 {
			return true, answer{}
		}
		if len(c.answers[id]) > 0 {
			return false, c.await(id)
		}
		if err := c.readOne(20 * time.Second); err != nil {
			c.t.Fatalf("waiting for request %d's first frame: %v", id, err)
		}
	}
}

// One org's tar walks on many connections, each bounded to 16 MiB of names, together held as much
// as they liked: with a 4.5 MiB budget (2.25 MiB for one org), six walks of 250 KB of names and a
// 256 KiB copy buffer each, whose clients do not read, all held them. Now the walks past the org's share are refused too_many_requests (saying
// to retry or ask for less), an ls and an edit past it too (the file unchanged), while another org
// is still served; and when the
// connections drop mid-walk, everything is given back.
func TestDataplaneOpMemoryIsOneBudget(t *testing.T) {
	b := servertest.New(t, servertest.Options{})
	server.SetOpMemoryBudget(b.Server, 4<<20+512<<10, 2<<20+256<<10)
	id, url := newSandbox(t, b, "wide")
	wideTree(t, workspaceDir(b, id))
	// An edit holds the file and its result while it runs: 128 KiB, twice over.
	text := strings.Repeat("0123456789abcde\n", 8<<10) + "needle\n"
	must(t, os.WriteFile(filepath.Join(workspaceDir(b, id), "edit-me.txt"), []byte(text), 0o644))
	key := b.Client.APIKey()

	var holding, refused []*rawConn
	for range 6 {
		c := dialRaw(t, url, key)
		c.sendJSON(protocol.Request{ID: 1, Op: protocol.OpTar, Args: map[string]any{"path": "wide"}})
		streaming, a := c.firstFrame(1)
		switch {
		case streaming:
			holding = append(holding, c)
		case a.code() == protocol.CodeTooManyRequests:
			if !strings.Contains(a.Error.Message, "Retry") || !strings.Contains(a.Error.Message, "nothing was changed") {
				t.Errorf("the refusal does not say what to do: %s", a)
			}
			refused = append(refused, c)
		default:
			t.Fatalf("tar: %s", a)
		}
	}
	if len(holding) != 4 || len(refused) != 2 {
		t.Fatalf("%d tar walks hold their names and %d were refused, want 4 and 2 (the org's share is 2.25 MiB; %+v held)",
			len(holding), len(refused), server.Usage(b.Server))
	}
	if got := server.OrgUsage(b.Server, b.Org).OpMemoryBytes; got > 2<<20+256<<10 || got < 1900<<10 {
		t.Errorf("the org holds %d bytes of the budget, want its four walks' names and buffers, at most its share", got)
	}
	// A listing draws on the same budget: the org's share is spent.
	if a := refused[0].call(2, protocol.OpLs, map[string]any{"path": "wide"}); a.code() != protocol.CodeTooManyRequests {
		t.Errorf("ls with the org's share spent: %s, want too_many_requests", a)
	}
	// And an edit, which then changes nothing.
	if a := refused[0].call(3, protocol.OpEdit, map[string]any{"path": "edit-me.txt", "old": "needle", "new": "pin"}); a.code() != protocol.CodeTooManyRequests || !strings.Contains(a.Error.Message, "nothing was changed") {
		t.Errorf("edit with the org's share spent: %s, want too_many_requests", a)
	}
	if got, _ := os.ReadFile(filepath.Join(workspaceDir(b, id), "edit-me.txt")); string(got) != text {
		t.Errorf("a refused edit changed the file")
	}
	refused[0].ping() // a refusal ends the request, not the connection

	// Another org is served, from the half of the budget the first cannot take.
	bystander := b.NewClient("other-org")
	res, err := bystander.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "bystander"})
	must(t, err)
	wideTree(t, workspaceDir(b, res.Sandbox.ID))
	oc := dialRaw(t, dataplaneURL(b, res.Sandbox.ID), bystander.APIKey())
	oc.sendJSON(protocol.Request{ID: 1, Op: protocol.OpTar, Args: map[string]any{"path": "wide"}})
	if streaming, a := oc.firstFrame(1); !streaming {
		t.Fatalf("another org's tar with the first org's share spent: %s", a)
	}
	if a := oc.call(2, protocol.OpLs, map[string]any{"path": "."}); a.Error != nil {
		t.Fatalf("another org's ls: %s", a)
	}

	// Connections that drop mid-walk give everything back.
	for _, c := range append(holding, oc) {
		c.ws.UnderlyingConn().Close()
	}
	if !wait.Until(10*time.Second, func() bool { return server.Usage(b.Server).OpMemoryBytes == 0 }) {
		t.Fatalf("after the connections dropped the broker still holds %+v", server.Usage(b.Server))
	}
	// And the refused request, sent again, is served.
	if a := refused[1].call(3, protocol.OpLs, map[string]any{"path": "wide"}); a.Error != nil {
		t.Fatalf("ls once the walks ended: %s", a)
	}
	if a := refused[1].call(4, protocol.OpEdit, map[string]any{"path": "edit-me.txt", "old": "needle", "new": "pin"}); a.Error != nil {
		t.Fatalf("edit once the walks ended: %s", a)
	}
	if !wait.Until(10*time.Second, func() bool { return server.Usage(b.Server).OpMemoryBytes == 0 }) {
		t.Fatalf("after the ls was answered the broker still holds %+v", server.Usage(b.Server))
	}
}

// dirsArchive is the start of a tar stream (no end-of-archive blocks: the extraction then waits for
// more) of n directories under top with names of about 200 bytes.
func dirsArchive(t *testing.T, top string, n int) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := range n {
		name := fmt.Sprintf("%s/d%05d-", top, i)
		must(t, tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + strings.Repeat("y", 200-len(name)) + "/", Mode: 0o755}))
	}
	must(t, tw.Flush())
	return buf.Bytes()
}

// sendData sends b as request id's data frames of up to 1 MiB each.
func (c *rawConn) sendData(id uint32, b []byte) {
	c.t.Helper()
	for len(b) > 0 {
		n := min(len(b), 1<<20)
		c.sendBinary(dataFrame(protocol.FrameData, id, b[:n]))
		b = b[n:]
	}
}

// Untars remember their directories' names until they end (64 in flight on a connection, 32 MiB
// of names each): an org's untars past its share of the budget are stopped too_many_requests,
// saying what stays; the budget is given back when an untar ends and when its connection drops
// mid-stream.
func TestDataplaneUntarsShareTheOpMemoryBudget(t *testing.T) {
	b := servertest.New(t, servertest.Options{})
	server.SetOpMemoryBudget(b.Server, 6<<20, 3<<20) // one untar (1.25 MiB of buffers, 430 KB of names) and a second's buffers fit
	_, url := newSandbox(t, b, "untars")
	key := b.Client.APIKey()

	// The first untar remembers 1,200 names of 200 bytes (about 430 KB with what it keeps beside
	// each) and waits for more.
	first := dialRaw(t, url, key)
	first.sendJSON(protocol.Request{ID: 1, Op: protocol.OpUntar, Args: map[string]any{"path": "t1"}})
	first.sendData(1, dirsArchive(t, "a", 1200))
	if !wait.Until(20*time.Second, func() bool { return server.Usage(b.Server).OpMemoryBytes >= 1<<20+256<<10+420_000 }) {
		t.Fatalf("the first untar holds %+v, want its buffers and its names", server.Usage(b.Server))
	}
	// A second as large passes the org's share: stopped.
	second := dialRaw(t, url, key)
	second.sendJSON(protocol.Request{ID: 1, Op: protocol.OpUntar, Args: map[string]any{"path": "t2"}})
	second.sendData(1, dirsArchive(t, "b", 1200))
	second.sendBinary(dataFrame(protocol.FrameEnd, 1, nil))
	a := second.await(1)
	if a.code() != protocol.CodeTooManyRequests || !strings.Contains(a.Error.Message, "untar was stopped") || !strings.Contains(a.Error.Message, "stay extracted") {
		t.Fatalf("an untar past the org's share: %s, want too_many_requests saying what stays", a)
	}
	if got := server.OrgUsage(b.Server, b.Org).OpMemoryBytes; got > 3<<20 {
		t.Errorf("the org holds %d bytes of the budget, over its share", got)
	}
	second.ping()

	// A connection that drops mid-untar gives its names back.
	first.ws.UnderlyingConn().Close()
	if !wait.Until(10*time.Second, func() bool { return server.Usage(b.Server).OpMemoryBytes == 0 }) {
		t.Fatalf("after the connection dropped the broker still holds %+v", server.Usage(b.Server))
	}
	// The refused untar sent again is served, and an untar that ends gives its names back.
	second.sendJSON(protocol.Request{ID: 2, Op: protocol.OpUntar, Args: map[string]any{"path": "t2"}})
	second.sendData(2, append(dirsArchive(t, "b", 1200), make([]byte, 1024)...))
	second.sendBinary(dataFrame(protocol.FrameEnd, 2, nil))
	if a := second.await(2); a.Error != nil {
		t.Fatalf("the untar sent again: %s", a)
	}
	if got := server.Usage(b.Server).OpMemoryBytes; got != 0 {
		t.Fatalf("after the untar ended the broker still holds %d bytes", got)
	}
}

// An untar holds its buffers (the pipe the connection fills, the extraction's copy buffer, over
// 1 MiB) for as long as it runs, and a client may open 64 on each of its connections and send them
// nothing: one credential's idle untars held GBs that no budget counted. They are drawn from the
// op memory budget with its names: past the org's share an untar is refused before it starts.
func TestDataplaneUntarBuffersDrawOnTheOpMemoryBudget(t *testing.T) {
	b := servertest.New(t, servertest.Options{})
	server.SetOpMemoryBudget(b.Server, 8<<20, 4<<20)
	_, url := newSandbox(t, b, "untarbufs")
	c := dialRaw(t, url, b.Client.APIKey())
	for id := uint32(1); id <= 3; id++ {
		c.sendJSON(protocol.Request{ID: id, Op: protocol.OpUntar, Args: map[string]any{"path": fmt.Sprintf("t%d", id)}})
	}
	c.ping() // the three are open
	if got := server.Usage(b.Server).OpMemoryBytes; got < 3<<20 {
		t.Fatalf("three idle untars hold %d bytes of the op memory budget, want their buffers (over 1 MiB each)", got)
	}
	c.sendJSON(protocol.Request{ID: 4, Op: protocol.OpUntar, Args: map[string]any{"path": "t4"}})
	if a := c.await(4); a.code() != protocol.CodeTooManyRequests {
		t.Fatalf("an untar past the org's share: %s, want too_many_requests", a)
	}
	if got := server.OrgUsage(b.Server, b.Org).OpMemoryBytes; got > 4<<20 {
		t.Errorf("the org holds %d bytes of the budget, over its share", got)
	}
	c.ws.UnderlyingConn().Close()
	if !wait.Until(10*time.Second, func() bool { return server.Usage(b.Server).OpMemoryBytes == 0 }) {
		t.Fatalf("after the connection dropped the broker still holds %+v", server.Usage(b.Server))
	}
}
