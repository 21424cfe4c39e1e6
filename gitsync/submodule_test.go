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

// TestPushReadsNothingThroughALinkedSubmodule: a repository whose submodule directory (or a parent
// of it) is a symbolic link to another repository outside sends the link, never the files it
// leads to, and a .gitmodules naming paths outside changes nothing.
func TestPushReadsNothingThroughALinkedSubmodule(t *testing.T) {
	top := t.TempDir()
	env := append(os.Environ(), "GIT_AUTHOR_NAME=T", "GIT_AUTHOR_EMAIL=t@example.com", "GIT_COMMITTER_NAME=T", "GIT_COMMITTER_EMAIL=t@example.com")
	gitIn := func(dir string, args ...string) string {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir, cmd.Env = dir, env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	mkrepo := func(name, file string) string {
		d := filepath.Join(top, name)
		gitIn(top, "init", "-q", "-b", "main", d)
		os.WriteFile(filepath.Join(d, file), []byte(name+"\n"), 0o644)
		gitIn(d, "add", "-A")
		gitIn(d, "commit", "-q", "-m", name)
		return d
	}
	secret := mkrepo("secret", "secret-key")
	lib := mkrepo("lib", "lib.txt")
	for _, c := range []struct{ name, sub, link string }{{"the submodule", "lib", "lib"}, {"its parent", "a/lib", "a"}} {
		t.Run(c.name, func(t *testing.T) {
			repo := mkrepo("repo-"+strings.ReplaceAll(c.sub, "/", "-"), "README")
			gitIn(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", lib, c.sub)
			gitIn(repo, "commit", "-q", "-m", "sub")
			os.RemoveAll(filepath.Join(repo, c.link))
			target := secret
			if c.link != c.sub {
				target = t.TempDir()
				os.Symlink(secret, filepath.Join(target, "lib"))
			}
			os.Symlink(target, filepath.Join(repo, c.link))
			f, _ := os.OpenFile(filepath.Join(repo, ".gitmodules"), os.O_APPEND|os.O_WRONLY, 0)
			f.WriteString("[submodule \"out\"]\n\tpath = ../secret\n\turl = " + secret + "\n[submodule \"abs\"]\n\tpath = " + secret + "\n\turl = " + secret + "\n")
			f.Close()
			r, err := Open(t.Context(), repo)
			if err != nil {
				t.Fatal(err)
			}
			snap, err := r.Snap(t.Context(), "", "")
			if err != nil {
				t.Fatal(err)
			}
			ls := gitIn(repo, "ls-tree", "-r", snap.Tree)
			if strings.Contains(ls, "secret-key") || strings.Contains(ls, "lib.txt") {
				t.Fatalf("the push's tree has files from outside the repository:\n%s", ls)
			}
			if !strings.Contains(ls, "120000 blob") {
				t.Fatalf("the link is not in the push's tree:\n%s", ls)
			}
		})
	}
}
