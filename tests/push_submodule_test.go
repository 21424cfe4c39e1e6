package tests

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/gitsync"
)

// submoduleRepo makes a repository with two submodules, local ones made here: lib (checked out,
// with a submodule of its own, vendor/deep, and then edited: a tracked file changed and an
// untracked one added, neither committed) and other (registered, not checked out).
func submoduleRepo(t *testing.T) string {
	t.Helper()
	origin := func(name string, files map[string]string) string {
		dir := filepath.Join(t.TempDir(), name)
		git(t, t.TempDir(), "init", "-q", "-b", "main", dir)
		git(t, dir, "config", "user.name", "Tester")
		git(t, dir, "config", "user.email", "t@example.com")
		for n, data := range files {
			write(t, dir, n, data)
		}
		git(t, dir, "add", "-A")
		git(t, dir, "commit", "-q", "-m", "first")
		return dir
	}
	sub := func(dir, url, p string) {
		git(t, dir, "-c", "protocol.file.allow=always", "submodule", "add", "-q", url, p)
	}
	deep := origin("deep", map[string]string{"deep.txt": "deep down\n"})
	lib := origin("lib", map[string]string{"lib.go": "package lib\n\nconst V = 1\n", ".gitignore": "*.tmp\n"})
	sub(lib, deep, "vendor/deep")
	git(t, lib, "commit", "-q", "-m", "deep")
	other := origin("other", map[string]string{"other.txt": "other\n"})

	repo := origin("repo", map[string]string{"README.md": "# top\n"})
	sub(repo, lib, "lib")
	sub(repo, other, "other")
	git(t, repo, "-c", "protocol.file.allow=always", "submodule", "update", "-q", "--init", "--recursive")
	git(t, repo, "commit", "-q", "-m", "submodules")
	git(t, repo, "submodule", "deinit", "-q", "-f", "other")

	write(t, repo, "lib/lib.go", "package lib\n\nconst V = 2 // dirty in the submodule\n")
	write(t, repo, "lib/new.txt", "untracked in the submodule\n")
	write(t, repo, "lib/junk.tmp", "ignored by the submodule's .gitignore\n")
	return repo
}

// TestPushSubmodules: a push sends the checked-out submodules' files as the person sees them
// (recursively, edits included, ignored files not), nothing of a submodule not checked out, and no
// .git; diff shows the agent's changes inside a submodule; pull writes them into the submodule's
// working tree; pull --branch refuses them (a branch cannot hold them) with what to do instead,
// and keeps the gitlink when only the superproject's files changed.
func TestPushSubmodules(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "box")
	repo := submoduleRepo(t)

	r := b.sbctl("push", "box", repo, "-o", "json")
	if r.code != 0 {
		t.Fatalf("push: %+v", r)
	}
	var pr gitsync.PushResult
	if err := json.Unmarshal([]byte(r.stdout), &pr); err != nil {
		t.Fatal(err)
	}
	if len(pr.Submodules) != 0 || strings.Contains(r.stderr, "submodule") {
		t.Fatalf("submodules left out: %+v\n%s", pr, r.stderr)
	}
	got := b.ok("exec", "box", "-c", "cat lib/lib.go lib/new.txt lib/vendor/deep/deep.txt; find . -name .git -o -name '*.tmp' -o -path './other/*'; test -f .gitmodules && echo gitmodules")
	want := "package lib\n\nconst V = 2 // dirty in the submodule\nuntracked in the submodule\ndeep down\ngitmodules\n"
	if got != want {
		t.Fatalf("the sandbox has:\n%s\nwant:\n%s", got, want)
	}
	if out := b.ok("push", "box", repo); !strings.Contains(out, "0 files sent") {
		t.Fatalf("a second push sent files: %q", out)
	}
	write(t, repo, "lib/vendor/deep/deep.txt", "deeper\n")
	if out := b.ok("push", "box", repo); !strings.Contains(out, "1 file sent") {
		t.Fatalf("an edit in the nested submodule: %q", out)
	}
	if out := b.ok("diff", "box", "--dir", repo); out != "" {
		t.Fatalf("diff right after a push: %q", out)
	}

	// The agent changes files inside the submodule and one of the superproject.
	b.ok("exec", "box", "-c", `set -e
sed -i 's/V = 2/V = 3/' lib/lib.go
echo agent > lib/agent.txt
rm lib/vendor/deep/deep.txt
echo '# top, by the agent' > README.md`)
	names := b.ok("diff", "box", "--dir", repo, "--name-only")
	if strings.Join(sortedLines(names), "") != "README.md\nlib/agent.txt\nlib/lib.go\nlib/vendor/deep/deep.txt\n" {
		t.Fatalf("diff --name-only:\n%s", names)
	}
	if patch := b.ok("diff", "box", "--dir", repo); !strings.Contains(patch, "-const V = 2 // dirty in the submodule") || !strings.Contains(patch, "+const V = 3") {
		t.Fatalf("diff:\n%s", patch)
	}

	r = b.sbctl("pull", "box", "--dir", repo, "--branch", "agent/box")
	if r.code == 0 || !strings.Contains(r.stderr, `submodule "lib"`) || !strings.Contains(r.stderr, "without --branch") {
		t.Fatalf("pull --branch with changes in a submodule: %+v", r)
	}
	if out := git(t, repo, "branch", "--list", "agent/box"); out != "" {
		t.Fatalf("a refused pull --branch made a branch: %q", out)
	}

	b.ok("pull", "box", "--dir", repo)
	local := func(p string) string { b, _ := os.ReadFile(filepath.Join(repo, p)); return string(b) }
	if local("lib/lib.go") != "package lib\n\nconst V = 3 // dirty in the submodule\n" || local("lib/agent.txt") != "agent\n" || local("README.md") != "# top, by the agent\n" {
		t.Fatalf("after pull: lib.go %q, agent.txt %q, README %q", local("lib/lib.go"), local("lib/agent.txt"), local("README.md"))
	}
	if _, err := os.Lstat(filepath.Join(repo, "lib/vendor/deep/deep.txt")); err == nil {
		t.Fatal("deep.txt, deleted in the sandbox, is still here")
	}
	// The changes are the submodule's own, unstaged there.
	if st := git(t, filepath.Join(repo, "lib"), "status", "--porcelain", "--ignore-submodules=none"); !strings.Contains(st, " M lib.go") || !strings.Contains(st, "?? agent.txt") {
		t.Fatalf("the submodule's status:\n%s", st)
	}

	// Only the superproject's files changed: the branch keeps the submodule as its gitlink.
	b.ok("push", "box", repo)
	b.ok("exec", "box", "-c", "echo '# top, again' > README.md")
	b.ok("pull", "box", "--dir", repo, "--branch", "agent/readme")
	if ls := git(t, repo, "ls-tree", "agent/readme", "lib", "other", "README.md"); !strings.Contains(ls, "160000 commit") || strings.Count(ls, "160000 commit") != 2 || !strings.Contains(ls, "README.md") {
		t.Fatalf("the branch's tree:\n%s", ls)
	}
	if diff := git(t, repo, "diff", "--name-only", "HEAD", "agent/readme"); diff != "README.md\n" {
		t.Fatalf("the branch changes more than README.md:\n%s", diff)
	}
}
