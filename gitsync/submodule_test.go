package gitsync

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestBranchTrailersAreTakenLiterally: the gitlinks a pushed commit names in its message are read
// back by pull --branch, and the message can come from anyone (a repository's own commit, pushed
// unchanged, is the base): a trailer whose path is pathspec magic must not take every file out of
// the branch, and one that is no valid path or commit is not a gitlink at all.
func TestBranchTrailersAreTakenLiterally(t *testing.T) {
	dir := t.TempDir()
	gitT := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=T", "GIT_AUTHOR_EMAIL=t@example.com", "GIT_COMMITTER_NAME=T", "GIT_COMMITTER_EMAIL=t@example.com")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	gitT("init", "-q", "-b", "main")
	os.MkdirAll(filepath.Join(dir, "src"), 0o755)
	os.WriteFile(filepath.Join(dir, "a.txt"), []byte("a\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "src", "b.txt"), []byte("b\n"), 0o644)
	gitT("add", "-A")
	hex := strings.Repeat("1", 40)
	gitT("commit", "-q", "-m", "hostile\n\n"+submoduleTrailer+hex+" :(glob)**\n"+submoduleTrailer+"HEAD src\n"+submoduleTrailer+hex+" ../out\n")
	r, err := Open(t.Context(), dir)
	if err != nil {
		t.Fatal(err)
	}
	base := gitT("rev-parse", "HEAD")
	links, err := r.flattened(t.Context(), base)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range links {
		if l.Path == "src" || l.Path == "../out" {
			t.Errorf("a trailer with no valid commit or path was taken: %+v", l)
		}
	}
	tree, err := r.SandboxTree(t.Context(), &Fetched{Base: base}, links...)
	if err != nil {
		t.Fatal(err)
	}
	ls := gitT("ls-tree", "-r", "--name-only", tree)
	if !strings.Contains(ls, "a.txt") || !strings.Contains(ls, "src/b.txt") {
		t.Fatalf("the branch's tree lost the repository's files:\n%s", ls)
	}
}
