package baseline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/membudget/membudgettest"
	"github.com/sbxbroker/broker/protocol"
)

func TestBlobIDIsGit(t *testing.T) {
	// git hash-object of "hello\n" and of nothing.
	if got := BlobID([]byte("hello\n")); got != "ce013625030ba8dba906f756967f9e9ca394464a" {
		t.Fatal(got)
	}
	if got := BlobID(nil); got != "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391" {
		t.Fatal(got)
	}
}

func TestParseRefusesGarbage(t *testing.T) {
	good := Record{Commit: "0123456789abcdef0123456789abcdef01234567", Entries: []Entry{
		{Path: "a b/c", Mode: ModeFile, OID: BlobID([]byte("x")), Size: 1, MtimeNS: 5},
		{Path: "l", Mode: ModeSymlink, OID: BlobID([]byte("a b")), Size: 3},
	}}
	var buf bytes.Buffer
	good.Write(&buf)
	if r, err := Parse(buf.Bytes()); err != nil || len(r.Entries) != 2 || r.Entries[0].Path != "a b/c" {
		t.Fatalf("round trip: %+v %v", r, err)
	}
	for name, b := range map[string]string{
		"empty":      "",
		"binary":     "\x00\x01\x02",
		"no commit":  "sbx-baseline 1\ncommit nope\n",
		"bad mode":   "sbx-baseline 1\ncommit 0123456789abcdef0123456789abcdef01234567\n100600 " + BlobID(nil) + " 0 0 a\n",
		"climbs":     "sbx-baseline 1\ncommit 0123456789abcdef0123456789abcdef01234567\n100644 " + BlobID(nil) + " 0 0 ../a\n",
		"into .git":  "sbx-baseline 1\ncommit 0123456789abcdef0123456789abcdef01234567\n100644 " + BlobID(nil) + " 0 0 x/.git/config\n",
		"unordered":  "sbx-baseline 1\ncommit 0123456789abcdef0123456789abcdef01234567\n100644 " + BlobID(nil) + " 0 0 b\n100644 " + BlobID(nil) + " 0 0 a\n",
		"negative":   "sbx-baseline 1\ncommit 0123456789abcdef0123456789abcdef01234567\n100644 " + BlobID(nil) + " -1 0 a\n",
		"truncated":  "sbx-baseline 1\ncommit 0123456789abcdef0123456789abcdef01234567\n100644 " + BlobID(nil) + " 0 0 a",
		"few fields": "sbx-baseline 1\ncommit 0123456789abcdef0123456789abcdef01234567\n100644 " + BlobID(nil) + " 0\n",
	} {
		if _, err := Parse([]byte(b)); !errors.Is(err, ErrDamaged) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// tree writes files and a record of them (mtimes as the record says), the record's own mtime
// set after everything, as a push leaves them.
func tree(t *testing.T, files map[string]string) (string, *os.Root) {
	t.Helper()
	dir := t.TempDir()
	mt := time.Unix(1_700_000_000, 0)
	rec := Record{Commit: "0123456789abcdef0123456789abcdef01234567"}
	for _, p := range []string{"a.txt", "d/b.bin", "d/e/c.txt"} {
		data, ok := files[p]
		if !ok {
			continue
		}
		full := filepath.Join(dir, p)
		os.MkdirAll(filepath.Dir(full), 0o755)
		os.WriteFile(full, []byte(data), 0o644)
		os.Chtimes(full, mt, mt)
		rec.Entries = append(rec.Entries, Entry{Path: p, Mode: ModeFile, OID: BlobID([]byte(data)), Size: int64(len(data)), MtimeNS: mt.UnixNano()})
	}
	os.Symlink("../../etc/passwd", filepath.Join(dir, "link"))
	rec.Entries = append(rec.Entries, Entry{Path: "link", Mode: ModeSymlink, OID: BlobID([]byte("../../etc/passwd")), Size: 16})
	var buf bytes.Buffer
	rec.Write(&buf)
	os.MkdirAll(filepath.Join(dir, ".sbx"), 0o755)
	os.WriteFile(filepath.Join(dir, protocol.BaselineRecord), buf.Bytes(), 0o644)
	// The record is newer than every file's ctime (a coarse clock could make them equal).
	later := time.Now().Add(time.Hour)
	os.Chtimes(filepath.Join(dir, protocol.BaselineRecord), later, later)
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { root.Close() })
	return dir, root
}

func TestChangesTrustsOnlyUntouchedFiles(t *testing.T) {
	files := map[string]string{"a.txt": "alpha\n", "d/b.bin": "\x00\x01bin", "d/e/c.txt": "gamma\n"}
	dir, root := tree(t, files)
	ctx := context.Background()
	res, err := Changes(ctx, root, Options{})
	if err != nil || len(res.Changes) != 0 || res.Hashed != 0 || res.Scanned != 4 {
		t.Fatalf("untouched tree: %+v %v", res, err)
	}

	// Same size, mtime put back: the ctime gives it away (its record is in the future, so
	// move the record's mtime to just now and let the change come after it).
	os.Chtimes(filepath.Join(dir, protocol.BaselineRecord), time.Now().Add(-time.Minute), time.Now().Add(-time.Minute))
	mt := time.Unix(1_700_000_000, 0)
	os.WriteFile(filepath.Join(dir, "a.txt"), []byte("ALPHA\n"), 0o644)
	os.Chtimes(filepath.Join(dir, "a.txt"), mt, mt)
	os.WriteFile(filepath.Join(dir, "new.txt"), []byte("n"), 0o755)
	os.Remove(filepath.Join(dir, "d/e/c.txt"))
	os.Mkdir(filepath.Join(dir, ".git"), 0o755)
	os.WriteFile(filepath.Join(dir, ".git/config"), []byte("[core]"), 0o644)
	os.WriteFile(filepath.Join(dir, "d/.git"), []byte("gitdir: x"), 0o644)
	res, err = Changes(ctx, root, Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := []protocol.Change{
		{Path: "a.txt", Status: protocol.ChangeModified, Mode: ModeFile, OID: BlobID([]byte("ALPHA\n")), Size: 6},
		{Path: "d/e/c.txt", Status: protocol.ChangeDeleted},
		{Path: "new.txt", Status: protocol.ChangeAdded, Mode: ModeExec, OID: BlobID([]byte("n")), Size: 1},
	}
	if len(res.Changes) != len(want) {
		t.Fatalf("changes: %+v", res.Changes)
	}
	for i := range want {
		if res.Changes[i] != want[i] {
			t.Fatalf("change %d: %+v, want %+v", i, res.Changes[i], want[i])
		}
	}
}

func TestChangesRecordHostile(t *testing.T) {
	dir, root := tree(t, map[string]string{"a.txt": "a"})
	rec := filepath.Join(dir, protocol.BaselineRecord)
	os.Remove(rec)
	if _, err := Changes(context.Background(), root, Options{}); !isCode(err, protocol.CodeFileNotFound) {
		t.Fatalf("no record: %v", err)
	}
	os.Symlink("/etc/passwd", rec)
	if _, err := Changes(context.Background(), root, Options{}); !isCode(err, protocol.CodeInvalidArgument) {
		t.Fatalf("a link for a record: %v", err)
	}
	os.Remove(rec)
	os.WriteFile(rec, []byte("sbx-baseline 1\ngarbage"), 0o644)
	if _, err := Changes(context.Background(), root, Options{}); !isCode(err, protocol.CodeInvalidArgument) {
		t.Fatalf("garbage: %v", err)
	}
}

func TestChangesBounded(t *testing.T) {
	_, root := tree(t, map[string]string{"a.txt": "a", "d/b.bin": "b", "d/e/c.txt": "c"})
	if _, err := Changes(context.Background(), root, Options{MaxEntries: 3}); !isCode(err, protocol.CodeTooLarge) {
		t.Fatalf("entries: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Changes(ctx, root, Options{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
}

func isCode(err error, code string) bool {
	var pe *protocol.Error
	return errors.As(err, &pe) && pe.Code == code
}

func TestChangesOnlyThesePaths(t *testing.T) {
	dir, root := tree(t, map[string]string{"a.txt": "a", "d/b.bin": "b", "d/e/c.txt": "c"})
	os.WriteFile(filepath.Join(dir, "a.txt"), []byte("A"), 0o644)
	os.WriteFile(filepath.Join(dir, "d/b.bin"), []byte("B"), 0o644)
	os.Remove(filepath.Join(dir, "d/e/c.txt"))
	os.WriteFile(filepath.Join(dir, "new"), []byte("n"), 0o644)
	// d/x is reached through a link: not the path itself, so it counts as absent.
	os.Symlink("d", filepath.Join(dir, "l"))
	res, err := Changes(context.Background(), root, Options{Only: []string{"a.txt", "d/e/c.txt", "new", "l/b.bin", "missing"}})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range res.Changes {
		got = append(got, c.Path+" "+c.Status)
	}
	if want := []string{"a.txt modified", "d/e/c.txt deleted", "new added"}; !slices.Equal(got, want) {
		t.Fatalf("got %q, want %q", got, want)
	}
	if _, err := Changes(context.Background(), root, Options{Only: []string{"../x"}}); !isCode(err, protocol.CodeInvalidArgument) {
		t.Fatalf("a climbing path: %v", err)
	}
}

// TestChangesLeavesOutGitDirAliases: a hostile sandbox names files so that sbctl pull, writing
// them into the person's repository on Windows or macOS, would land them in its .git (a hook runs
// at the next commit): NTFS reads ".git." and ".git " and "GIT~1" and ".git::$INDEX_ALLOCATION" as
// .git and a backslash as a separator (so "x\..\.git\hooks" goes up), HFS+ ignores zero-width code
// points. The scan leaves them out (skipped) like .git itself, and pull's check refuses them; names
// that only look alike stay.
func TestChangesLeavesOutGitDirAliases(t *testing.T) {
	dir, root := tree(t, map[string]string{"a.txt": "a"})
	hostile := []string{
		".git.", ".git ", ".GIT. .", "git~1", "GIT~1.", ".git::$INDEX_ALLOCATION", ".git:x",
		`.git\hooks\pre-commit`, `hooks\..\.git\hooks\pre-commit`, `x\..\..\escape`, `a\.\b`, `a\...\b`,
		".g\u200cit", "\ufeff.git", ".gi\u200dt",
	}
	fine := []string{`a\b`, ".github", ".gitignore", "git~2", "x.git", "..x", "a.git.", "git~1x"}
	for _, name := range append(slices.Clone(hostile), fine...) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{".git.", "d/git~1"} { // as directories too
		os.MkdirAll(filepath.Join(dir, "sub", name), 0o755)
		os.WriteFile(filepath.Join(dir, "sub", name, "hook"), []byte("x"), 0o755)
	}
	res, err := Changes(context.Background(), root, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range res.Changes {
		got = append(got, c.Path)
		if err := ValidPath(c.Path); err != nil {
			t.Errorf("a change at %q, which ValidPath refuses: %v", c.Path, err)
		}
	}
	for _, name := range hostile {
		if slices.Contains(got, name) {
			t.Errorf("%q was reported as a change; pull would write it", name)
		}
		if ValidPath(name) == nil || ValidPath("d/"+name+"/x") == nil {
			t.Errorf("ValidPath accepts %q", name)
		}
	}
	for _, p := range []string{"sub/.git./hook", "sub/d/git~1/hook"} {
		if slices.Contains(got, p) {
			t.Errorf("%q was reported as a change", p)
		}
	}
	for _, name := range fine {
		if !slices.Contains(got, name) {
			t.Errorf("%q is an ordinary name and was left out (changes %v, skipped %v)", name, got, res.Skipped)
		}
	}
}

// TestChangesReadsNamesWithinItsBound: a directory's names are read in batches and counted as they
// come, so a directory of far more entries than MaxEntries (a sandbox makes its own tree) costs the
// broker no more than the bound: it was read whole first, then counted.
func TestChangesReadsNamesWithinItsBound(t *testing.T) {
	dir, root := tree(t, map[string]string{"a.txt": "a"})
	long := strings.Repeat("n", 200)
	for i := range 20_000 {
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("%s-%05d", long, i)))
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := Changes(context.Background(), root, Options{MaxEntries: 100})
	runtime.ReadMemStats(&after)
	if !isCode(err, protocol.CodeTooLarge) {
		t.Fatalf("past MaxEntries: %v", err)
	}
	// 20,000 names of 206 bytes are over 4 MB; the bound's 100 names and a batch, some KB.
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
		t.Fatalf("Changes allocated %d bytes to stop at 100 entries", alloc)
	}
}

// TestChangesBoundsThePathsItHolds: the directories found and not yet visited are bounded in bytes
// (a path may be 4096 bytes), not only in count.
func TestChangesBoundsThePathsItHolds(t *testing.T) {
	old := maxPendingBytes
	maxPendingBytes = 4 << 10
	defer func() { maxPendingBytes = old }()
	dir, root := tree(t, map[string]string{"a.txt": "a"})
	long := strings.Repeat("d", 200)
	for i := range 40 { // 40 × 203 bytes, past 4 KiB
		if err := os.Mkdir(filepath.Join(dir, fmt.Sprintf("%s%03d", long, i)), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Changes(context.Background(), root, Options{}); !isCode(err, protocol.CodeTooLarge) {
		t.Fatalf("40 long directory names past the bound: %v", err)
	}
	for i := range 30 {
		os.Remove(filepath.Join(dir, fmt.Sprintf("%s%03d", long, i)))
	}
	if _, err := Changes(context.Background(), root, Options{}); err != nil {
		t.Fatalf("10 of them: %v", err)
	}
}

// TestParseAllocatesForWhatItReads: a record's size is bounded (64 MiB), but its line count was
// taken as the entry count before any line was checked: a record of newlines (the sandbox may write
// .sbx/baseline) made Parse allocate 24 bytes of slice header and 64 bytes of entry per byte, GBs
// for one changes request. It stops at the first bad line having allocated next to nothing.
func TestParseAllocatesForWhatItReads(t *testing.T) {
	b := []byte("sbx-baseline 1\ncommit 0123456789abcdef0123456789abcdef01234567\n" + strings.Repeat("\n", 8<<20))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := Parse(b)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrDamaged) {
		t.Fatalf("Parse of a record of newlines: %v", err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
		t.Fatalf("Parse allocated %d bytes to refuse line 3 of an 8 MiB record", alloc)
	}
}

// TestChangesRefusesARecordPastItsBounds: a record with more entries than a walk could ever
// compare (MaxEntries looked at plus MaxChanges answered) is refused before it is parsed.
func TestChangesRefusesARecordPastItsBounds(t *testing.T) {
	dir, root := tree(t, map[string]string{"a.txt": "a"})
	var rec Record
	rec.Commit = "0123456789abcdef0123456789abcdef01234567"
	for i := range 50 {
		rec.Entries = append(rec.Entries, Entry{Path: fmt.Sprintf("f%03d", i), Mode: ModeFile, OID: BlobID(nil)})
	}
	var buf bytes.Buffer
	rec.Write(&buf)
	if err := os.WriteFile(filepath.Join(dir, protocol.BaselineRecord), buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Changes(context.Background(), root, Options{MaxEntries: 20, MaxChanges: 20})
	if !isCode(err, protocol.CodeTooLarge) || !strings.Contains(err.Error(), "recorded") {
		t.Fatalf("a record of 50 entries past 20 looked at and 20 answered: %v", err)
	}
	// With paths, no walk: the record is looked up, and its size alone bounds it.
	res, err := Changes(context.Background(), root, Options{MaxEntries: 20, MaxChanges: 20, Only: []string{"f007"}})
	if err != nil || len(res.Changes) != 1 || res.Changes[0].Status != protocol.ChangeDeleted {
		t.Fatalf("one path of a record of 50: %+v %v", res, err)
	}
}

// TestChangesBoundsItsAnswer: the changes and skipped names one walk answers are bounded in bytes,
// not only in count: a path may be 4096 bytes, and a skipped name is quoted (a control character
// shown as four), so 100,000 changes were up to 400 MB held and sent as one answer.
func TestChangesBoundsItsAnswer(t *testing.T) {
	old := maxAnswerBytes
	maxAnswerBytes = 8 << 10
	defer func() { maxAnswerBytes = old }()
	for _, name := range []string{"added-%03d-" + strings.Repeat("n", 200), "skipped-%03d-" + strings.Repeat("\x01", 200)} {
		dir, root := tree(t, map[string]string{"a.txt": "a"})
		for i := range 60 { // 60 × over 200 bytes, past 8 KiB
			if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf(name, i)), nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := Changes(context.Background(), root, Options{}); !isCode(err, protocol.CodeTooLarge) || !strings.Contains(err.Error(), "MiB of answer") {
			t.Fatalf("%.10s: 60 long names past an 8 KiB answer: %v", name, err)
		}
	}
}

// TestChangesDrawsOnTheCallersBudget: the record, the names and the answer a scan holds are drawn
// from the budget the caller puts in the context (in the broker, one shared by every request); a
// scan that would pass it stops with the budget's own error.
func TestChangesDrawsOnTheCallersBudget(t *testing.T) {
	dir, root := tree(t, map[string]string{"a.txt": "alpha\n", "d/b.bin": "bin", "d/e/c.txt": "gamma\n"})
	os.WriteFile(filepath.Join(dir, "new.txt"), []byte("n"), 0o644)
	m := &membudgettest.Meter{Limit: 1 << 20}
	res, err := Changes(membudget.With(context.Background(), m), root, Options{})
	if err != nil || len(res.Changes) != 1 {
		t.Fatalf("changes: %+v %v", res, err)
	}
	if m.Held == 0 {
		t.Fatal("the scan drew nothing from its caller's budget")
	}
	small := &membudgettest.Meter{Limit: m.Held / 2}
	if _, err := Changes(membudget.With(context.Background(), small), root, Options{}); !errors.Is(err, membudgettest.ErrSpent) {
		t.Fatalf("a scan past its caller's budget: %v, want the budget's error", err)
	}
}
