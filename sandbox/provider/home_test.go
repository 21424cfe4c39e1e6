package provider

import (
	"bytes"
	"context"
	"testing"
	"time"
)

// The sandbox user has a home of its own outside the workspace: git's and other tools' dotfiles
// (~/.gitconfig, caches) must not land in the project, where `git add -A` committed .gitconfig.
func TestNamespaceHomeIsNotTheWorkspace(t *testing.T) {
	n := newNamespace(t, Config{})
	in, _ := startSandbox(t, n, Template{})
	var buf bytes.Buffer
	res, err := in.Exec(context.Background(), ExecRequest{Command: `set -e
echo "HOME=$HOME passwd=$(getent passwd user | cut -d: -f6)"
cd /workspace && git init -q
git config --global user.email u@x && git config --global user.name u
echo a > a && git add -A && git commit -qm m
git show --name-only --format= HEAD
test -w "$HOME" && test -f "$HOME/.gitconfig" && cd && pwd -P`, Stdout: &buf, Stderr: &buf, Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	want := "HOME=/home/user passwd=/home/user\na\n/tmp/home\n"
	if res.ExitCode != 0 || buf.String() != want {
		t.Fatalf("exit %d:\n%s\nwant:\n%s", res.ExitCode, buf.String(), want)
	}
}
