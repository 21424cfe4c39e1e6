package tests

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/gitsync"
	"github.com/sbxbroker/broker/protocol"
)

// gitRepo makes a local repository: committed text, binary and executable files, a symlink inside
// the repository and two leading out of it, an ignored file, then (uncommitted) a modified file
// and an untracked one.
func gitRepo(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	git(t, dir, "init", "-q", "-b", "main")
	git(t, dir, "config", "user.name", "Tester")
	git(t, dir, "config", "user.email", "t@example.com")
	bin := make([]byte, 300<<10)
	rand.Read(bin)
	for name, data := range map[string]string{
		"README.md":         "# demo\n",
		"src/main.go":       "package main\n\nfunc main() {\n\tprintln(\"one\")\n}\n",
		"src/util.go":       "package main\n\nfunc util() int { return 1 }\n",
		"src/old_name.go":   "package main\n\n// this file will be renamed in the sandbox\nconst x = 42\n",
		"docs/gone.md":      "this file will be deleted in the sandbox\n",
		"assets/logo.bin":   string(bin),
		"run.sh":            "#!/bin/sh\necho run\n",
		".gitignore":        "build/\n*.log\n",
		"keep/deleted-here": "deleted locally before the second push\n",
	} {
		write(t, dir, name, data)
	}
	os.Chmod(filepath.Join(dir, "run.sh"), 0o755)
	for l, target := range map[string]string{"link-in": "src/main.go", "link-abs": "/etc/passwd", "link-up": "../../outside"} {
		if err := os.Symlink(target, filepath.Join(dir, l)); err != nil {
			t.Fatal(err)
		}
	}
	git(t, dir, "add", "-A")
	git(t, dir, "commit", "-q", "-m", "first")
	write(t, dir, "build/out.o", "ignored\n")
	write(t, dir, "src/util.go", "package main\n\nfunc util() int { return 2 } // dirty\n")
	write(t, dir, "notes.txt", "untracked, not ignored\n")
	return dir
}

func write(t *testing.T, dir, name, data string) {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func git(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestPushDiffPull is the round trip of issue 13 through the real binaries: push a repository
// (dirty working tree, symlinks out of it, binary files), push again incrementally, let the
// sandbox change, add, delete and rename files (binary too), diff, pull onto a branch and into the
// working tree, refuse to clobber local changes, and survive a damaged baseline.
func TestPushDiffPull(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "box")
	repo := gitRepo(t)

	var pr gitsync.PushResult
	if err := json.Unmarshal([]byte(b.ok("push", "box", repo, "-o", "json")), &pr); err != nil {
		t.Fatal(err)
	}
	if !pr.Full || !pr.Synthetic || pr.Sent != 13 || pr.Deleted != 0 {
		t.Fatalf("first push: %+v", pr)
	}
	got := b.ok("exec", "box", "-c", "cat src/util.go notes.txt && readlink link-abs link-up link-in && test ! -e build && stat -c %a run.sh && cmp -s assets/logo.bin /dev/stdin < assets/logo.bin && ls -a")
	for _, want := range []string{"return 2 } // dirty", "untracked, not ignored", "/etc/passwd\n../../outside\nsrc/main.go\n", "755\n", ".sbx\n"} {
		if !strings.Contains(got, want) {
			t.Fatalf("after the first push, %q missing from:\n%s", want, got)
		}
	}
	if strings.Contains(got, ".git\n") {
		t.Fatalf("a .git was pushed:\n%s", got)
	}

	// Nothing changed: nothing sent. One file touched and one deleted: exactly those.
	if out := b.ok("push", "box", repo); !strings.Contains(out, "0 files sent") || !strings.Contains(out, "13 unchanged") {
		t.Fatalf("second push: %q", out)
	}
	write(t, repo, "README.md", "# demo, edited\n")
	os.Remove(filepath.Join(repo, "keep/deleted-here"))
	if out := b.ok("push", "box", repo); !strings.Contains(out, "1 file sent") || !strings.Contains(out, "1 deleted") {
		t.Fatalf("incremental push: %q", out)
	}
	if got := b.ok("exec", "box", "-c", "cat README.md; test -e keep && echo keep-still-there; true"); got != "# demo, edited\n" {
		t.Fatalf("after the incremental push: %q", got)
	}
	if out := b.ok("diff", "box", "--dir", repo); out != "" {
		t.Fatalf("diff right after a push: %q", out)
	}

	// The agent works: modify, add (text and binary), delete, rename, chmod, an ignored file, and
	// its own git repository (never part of the changes).
	b.ok("exec", "box", "-c", `set -e
sed -i 's/one/two/' src/main.go
echo 'new file' > src/new.go
head -c 200000 /dev/urandom > assets/data.bin
printf 'x' >> assets/logo.bin
rm -r docs && echo 'now a file' > docs
mv src/old_name.go src/new_name.go
chmod +x src/util.go
mkdir -p build && echo junk > build/x.o && echo log > debug.log
git init -q . && git config user.email a@b && git config user.name a && git add -A && git commit -qm agent`)

	names := b.ok("diff", "box", "--dir", repo, "--name-only")
	want := "assets/data.bin\nassets/logo.bin\ndocs\ndocs/gone.md\nsrc/main.go\nsrc/new.go\nsrc/new_name.go\nsrc/util.go\n"
	if strings.Join(sortedLines(names), "") != want {
		t.Fatalf("diff --name-only:\n%s\nwant:\n%s", names, want)
	}
	if stat := b.ok("diff", "box", "--dir", repo, "--stat"); !strings.Contains(stat, "src/{old_name.go => new_name.go}") || !strings.Contains(stat, "Bin ") {
		t.Fatalf("diff --stat finds no rename or binary:\n%s", stat)
	}
	patch := b.ok("diff", "box", "--dir", repo)
	if !strings.Contains(patch, "GIT binary patch") || !strings.Contains(patch, "-\tprintln(\"one\")") || !strings.Contains(patch, "rename from src/old_name.go") {
		t.Fatalf("diff patch:\n%.3000s", patch)
	}

	// The patch applies to the pushed base and gives the sandbox's files, binaries included.
	base := strings.TrimSpace(git(t, repo, "rev-parse", "refs/sbctl/"+sandboxID(t, b, "box")))
	wt := filepath.Join(t.TempDir(), "wt")
	git(t, repo, "worktree", "add", "-q", "--detach", wt, base)
	cmd := exec.Command("git", "apply", "--index", "-")
	cmd.Dir, cmd.Stdin = wt, strings.NewReader(patch)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("git apply of sbctl diff: %v\n%s", err, out)
	}
	sandboxSums := b.ok("exec", "box", "-c", "md5sum assets/data.bin assets/logo.bin src/main.go src/new_name.go")
	cmd = exec.Command("md5sum", "assets/data.bin", "assets/logo.bin", "src/main.go", "src/new_name.go")
	cmd.Dir = wt
	if out, _ := cmd.Output(); string(out) != sandboxSums {
		t.Fatalf("the applied patch differs from the sandbox:\n%s\nvs\n%s", out, sandboxSums)
	}

	// --branch: a commit on the pushed base, nothing written in the working tree.
	if out := b.ok("pull", "box", "--dir", repo, "--branch", "agent/box"); !strings.Contains(out, "git merge agent/box") {
		t.Fatalf("pull --branch: %q", out)
	}
	if got := git(t, repo, "diff", "--name-status", "-M", base, "agent/box"); !strings.Contains(got, "R100\tsrc/old_name.go\tsrc/new_name.go") || !strings.Contains(got, "D\tdocs/gone.md") {
		t.Fatalf("branch content:\n%s", got)
	}
	if parent := strings.TrimSpace(git(t, repo, "rev-parse", "agent/box^")); parent != base {
		t.Fatalf("branch parent %s, want the pushed base %s", parent, base)
	}
	if st := git(t, repo, "status", "--porcelain"); strings.Contains(st, "new.go") {
		t.Fatalf("pull --branch wrote files:\n%s", st)
	}

	// A local uncommitted change to a file the sandbox changed: the pull refuses and writes nothing.
	write(t, repo, "src/main.go", "package main\n\n// mine\nfunc main() {\n\tprintln(\"one\")\n}\n")
	r := b.sbctl("pull", "box", "--dir", repo)
	if r.code != 5 || !strings.Contains(r.stderr, "src/main.go") || !strings.Contains(r.stderr, "--force") {
		t.Fatalf("pull over a local change: %+v", r)
	}
	if _, err := os.Stat(filepath.Join(repo, "src/new.go")); err == nil {
		t.Fatal("a refused pull wrote files")
	}
	// --force merges three ways: both edits are kept.
	b.ok("pull", "box", "--dir", repo, "--force")
	if b, _ := os.ReadFile(filepath.Join(repo, "src/main.go")); string(b) != "package main\n\n// mine\nfunc main() {\n\tprintln(\"two\")\n}\n" {
		t.Fatalf("merged main.go: %q", b)
	}
	local := func(p string) string { b, _ := os.ReadFile(filepath.Join(repo, p)); return string(b) }
	if local("src/new.go") != "new file\n" || local("src/new_name.go") == "" || local("docs") != "now a file\n" {
		t.Fatalf("pulled files missing")
	}
	for _, p := range []string{"docs/gone.md", "src/old_name.go", "debug.log"} {
		if _, err := os.Lstat(filepath.Join(repo, p)); err == nil {
			t.Fatalf("%s is still (or now) here after the pull", p)
		}
	}
	if fi, err := os.Stat(filepath.Join(repo, "src/util.go")); err != nil || fi.Mode()&0o100 == 0 {
		t.Fatalf("mode change not pulled: %v %v", fi, err)
	}
	sums := exec.Command("md5sum", "assets/data.bin", "assets/logo.bin")
	sums.Dir = repo
	if out, _ := sums.Output(); !strings.HasPrefix(sandboxSums, string(out[:len(out)/2])) {
		t.Fatalf("pulled binaries differ:\n%s\n%s", out, sandboxSums)
	}
	// Once committed, pulling again changes nothing (the merged file merges cleanly into itself).
	git(t, repo, "add", "-A")
	git(t, repo, "commit", "-q", "-m", "with the agent's work")
	if out := b.ok("pull", "box", "--dir", repo); !strings.Contains(out, "0 updated, 0 deleted, 1 merged, 0 conflicts") {
		t.Fatalf("second pull: %q", out)
	}
	// The merged main.go differs from the sandbox's: pushing it over the sandbox's change needs
	// --force; every other pulled file is what the sandbox has, so it is no conflict.
	r = b.sbctl("push", "box", repo)
	if r.code != 5 || !strings.Contains(r.stderr, `"src/main.go" since the last push`) {
		t.Fatalf("push of a merged file: %+v", r)
	}
	b.ok("push", "box", repo, "--force")
	if out := b.ok("diff", "box", "--dir", repo, "--name-only"); out != "" {
		t.Fatalf("diff after pull and push: %q", out)
	}

	// A push never overwrites the sandbox's changes unless told.
	b.ok("exec", "box", "-c", "echo sandbox > README.md")
	write(t, repo, "README.md", "local\n")
	r = b.sbctl("push", "box", repo)
	if r.code != 5 || !strings.Contains(r.stderr, "README.md") {
		t.Fatalf("push over a sandbox change: %+v", r)
	}
	b.ok("push", "box", repo, "--force")
	if got := b.ok("exec", "box", "-c", "cat README.md"); got != "local\n" {
		t.Fatalf("push --force: %q", got)
	}

	// A sandbox that replaces its baseline with garbage gets a clear error, and push --force mends it.
	b.ok("exec", "box", "-c", "head -c 5000 /dev/urandom > .sbx/baseline")
	r = b.sbctl("diff", "box", "--dir", repo)
	if r.code == 0 || !strings.Contains(r.stderr, "damaged") || !strings.Contains(r.stderr, "--force") {
		t.Fatalf("diff with a damaged baseline: %+v", r)
	}
	if r := b.sbctl("push", "box", repo); r.code == 0 || !strings.Contains(r.stderr, "damaged") {
		t.Fatalf("push with a damaged baseline: %+v", r)
	}
	// A baseline over 64 MiB (sparse here; it could be a terabyte) is refused as such once push
	// has read 64 MiB of it: push reads no more of what the sandbox put there into memory.
	b.ok("exec", "box", "-c", "rm .sbx/baseline && truncate -s 128M .sbx/baseline")
	if r := b.sbctl("push", "box", repo); r.code == 0 || !strings.Contains(r.stderr, "damaged") || !strings.Contains(r.stderr, "64 MiB") {
		t.Fatalf("push with a baseline of 128 MiB: %+v", r)
	}
	b.ok("exec", "box", "-c", "rm .sbx/baseline && ln -s /etc/shadow .sbx/baseline")
	if r := b.sbctl("diff", "box", "--dir", repo); r.code == 0 || !strings.Contains(r.stderr, "damaged") {
		t.Fatalf("diff with a baseline symlink: %+v", r)
	}
	b.ok("push", "box", repo, "--force")
	if out := b.ok("diff", "box", "--dir", repo, "--name-only"); out != "" {
		t.Fatalf("diff after a mending push: %q", out)
	}

	// create --from: create plus push; a DIR that is no repository changes nothing.
	if out := b.ok("create", "box2", "--from", repo); !strings.Contains(out, "created sandbox box2") || !strings.Contains(out, "files sent") {
		t.Fatalf("create --from: %q", out)
	}
	if r := b.sbctl("create", "box3", "--from", t.TempDir()); r.code != 2 || !strings.Contains(r.stderr, "git") {
		t.Fatalf("create --from a plain directory: %+v", r)
	}
	if r := b.sbctl("get", "box3"); r.code != 3 {
		t.Fatalf("create --from a plain directory created the sandbox: %+v", r)
	}
	for _, c := range []string{"push", "diff", "pull"} {
		if h := b.ok(c, "--help"); !strings.Contains(h, "sbctl "+c+" dev") {
			t.Fatalf("%s --help has no example:\n%s", c, h)
		}
	}
}

func sortedLines(s string) []string {
	ls := strings.SplitAfter(s, "\n")
	slices.Sort(ls)
	return ls
}

func sandboxID(t *testing.T, b *broker, name string) string {
	var sb protocol.Sandbox
	if err := json.Unmarshal([]byte(b.ok("get", name, "-o", "json")), &sb); err != nil {
		t.Fatal(err)
	}
	return sb.ID
}

// TestPushScopes: push needs fs:write (and fs:read, to compare); diff and pull need fs:read only,
// no exec, because the broker compares the files itself.
func TestPushScopes(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "sc")
	repo := gitRepo(t)
	ctx := context.Background()
	dial := func(scope string) *backend.Remote {
		var mint protocol.MintResponse
		if err := json.Unmarshal([]byte(b.ok("delegate", "sc", "--scope", scope, "-o", "json")), &mint); err != nil {
			t.Fatal(err)
		}
		r, err := backend.Dial(ctx, backend.Config{URL: mint.Sandbox.DataplaneURL, Credential: mint.Token})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		return r
	}
	g, err := gitsync.Open(ctx, repo)
	if err != nil {
		t.Fatal(err)
	}
	var pe *protocol.Error
	if _, err := gitsync.Push(ctx, dial("fs:read,exec"), g, gitsync.PushOptions{}); !errors.As(err, &pe) || pe.Code != protocol.CodeScopeDenied {
		t.Fatalf("push without fs:write: %v", err)
	}
	if _, err := gitsync.Push(ctx, dial("fs:read,fs:write"), g, gitsync.PushOptions{}); err != nil {
		t.Fatalf("push with fs:read,fs:write: %v", err)
	}
	b.ok("exec", "sc", "-c", "echo changed >> README.md")
	reader := dial("fs:read")
	f, err := gitsync.Fetch(ctx, reader, g)
	if err != nil || len(f.Changes) != 1 || f.Changes[0].Path != "README.md" {
		t.Fatalf("fetch with fs:read only: %+v %v", f, err)
	}
	var patch bytes.Buffer
	if err := g.Diff(ctx, f, "", false, &patch); err != nil || !strings.Contains(patch.String(), "+changed") {
		t.Fatalf("diff with fs:read only: %v %q", err, patch.String())
	}
	if _, err := gitsync.Fetch(ctx, dial("exec"), g); !errors.As(err, &pe) || pe.Code != protocol.CodeScopeDenied {
		t.Fatalf("fetch without fs:read: %v", err)
	}
}

// A sandbox that turns a pulled symlink leading out of the repository into a directory with a
// file in it: diff and pull refuse with a message and exit 1, and write nothing through the
// link. sbctl took git's failure (*exec.ExitError) for a sandbox command's exit and exited 128,
// as if killed by a signal, with no message at all.
func TestPullThroughALocalSymlinkIsRefusedWithAMessage(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "box")
	repo, outside := t.TempDir(), t.TempDir()
	git(t, repo, "init", "-q", "-b", "main")
	git(t, repo, "config", "user.name", "Tester")
	git(t, repo, "config", "user.email", "t@example.com")
	write(t, repo, "README.md", "# demo\n")
	if err := os.Symlink(outside, filepath.Join(repo, "evil")); err != nil {
		t.Fatal(err)
	}
	git(t, repo, "add", "-A")
	git(t, repo, "commit", "-q", "-m", "first")
	b.ok("push", "box", repo)
	b.ok("exec", "box", "-c", "rm evil && mkdir evil && echo pwned > evil/pwn.txt")
	for _, args := range [][]string{{"diff", "box", "--dir", repo}, {"pull", "box", "--dir", repo}} {
		r := b.sbctl(args...)
		if r.code != 1 || !strings.Contains(r.stderr, "sbctl: ") || !strings.Contains(r.stderr, "evil/pwn.txt") {
			t.Errorf("sbctl %s: exit %d, want 1 with a message naming evil/pwn.txt\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
		}
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Fatalf("pull wrote through the symlink: %v", ents)
	}
}
