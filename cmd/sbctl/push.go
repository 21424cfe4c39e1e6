package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/gitsync"
	"github.com/sbxbroker/broker/protocol"
)

// The sandbox side of push, diff and pull (gitsync) is described once, here, for all three --help
// texts.
const pushModel = `The baseline: a push records in the sandbox, at /workspace/.sbx/baseline, the commit it sent
and each file's git blob id, size and mtime; the same commit is kept in your repository as
refs/sbctl/<sandbox id>. It is not a git repository: the sandbox needs no git, and whatever git
the agent uses in /workspace (its own .git, any branch) is its own. diff and pull ask the broker
what differs from that record (it hashes changed files where they are, needing only the fs:read
scope: no exec), fetch those files, and compare them with the pushed commit in your repository.
Paths named .git and the .sbx directory are never pushed nor compared; files the sandbox adds that
your repository ignores (.gitignore, info/exclude) are left out.`

func pushCmd(g *globals) *cobra.Command {
	var rev string
	var force bool
	cmd := outputs(&cobra.Command{
		Use:   "push REF [DIR]",
		Short: "Send a git working tree (or a commit) into a sandbox's /workspace, then only what changed",
		Long: `Push the git repository at DIR (default: the one the current directory is in) into the sandbox's
/workspace: its tracked files as they are on disk plus the untracked files it does not ignore (the
working tree as git status sees it), or with --rev exactly the files of a commit. Symlinks are sent
as symlinks (never followed, wherever they point). A checked-out submodule's files go too, as you
see them (its uncommitted edits and untracked files, its own submodules), under its path; one not
checked out has no files to send; with --rev, or in a repository without .gitmodules (embedded
repositories), submodules are left out (with a warning). sbctl diff
shows the agent's changes inside a submodule like any other, sbctl pull writes them into the
submodule's working tree (its own repository), and pull --branch refuses them.

The first push sends everything in one tar stream. Later pushes send only the files whose content
(git blob id) or mode differ from what was pushed last, and delete what is gone: after editing one
file of a 10,000-file repository, a push sends that file (a fraction of a second). A push never overwrites or deletes a
file the sandbox changed since the last push unless --force: see sbctl diff, sbctl pull.

The files go first and the baseline last: a push that fails midway (a full disk, a lost
connection) leaves the old baseline, and the files it did send show in sbctl diff until you push
again.

When the working tree differs from HEAD, the push makes a commit of it (on top of HEAD, named by no
branch; your index and HEAD are untouched): that is the base sbctl diff and pull compare with.

` + pushModel + `

Needs the fs:read and fs:write scopes (an owner's key has both).`,
		Example: `  sbctl push dev                  # the repository here, as its working tree is
  sbctl push dev ~/src/app        # another repository
  sbctl push dev --rev v1.2.0     # exactly a tag's files
  sbctl push dev --force          # overwrite what the sandbox changed; re-record a damaged baseline`,
		Args: rangeArgs(1, 2, "REF and at most one DIR"),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir := "."
			if len(args) == 2 {
				dir = args[1]
			}
			res, err := g.push(cmd.Context(), args[0], dir, gitsync.PushOptions{Rev: rev, Force: force})
			if err != nil {
				return err
			}
			return g.printPush(res)
		},
	}, "it prints what it sent as JSON or YAML, or a summary", "table", "json", "yaml")
	cmd.Flags().StringVar(&rev, "rev", "", "push exactly this commit (a branch, tag or id) instead of the working tree")
	cmd.Flags().BoolVar(&force, "force", false, "overwrite files the sandbox changed since the last push; send everything when its baseline is damaged")
	return cmd
}

func rangeArgs(lo, hi int, what string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) < lo || len(args) > hi {
			return usage.Errorf("%s takes %s; see %s --help", cmd.Name(), what, cmd.CommandPath())
		}
		return nil
	}
}

// dialRef opens REF's dataplane with the owner's key and returns the sandbox too.
func (g *globals) dialRef(ctx context.Context, ref string) (*backend.Remote, protocol.Sandbox, error) {
	c, err := g.client()
	if err != nil {
		return nil, protocol.Sandbox{}, err
	}
	sb, err := c.GetSandbox(ctx, ref)
	if err != nil {
		return nil, sb, err
	}
	dp := sb.DataplaneURL
	if dp == "" {
		dp = c.DataplaneURL(sb.ID)
	}
	r, err := backend.Dial(ctx, backend.Config{URL: dp, Credential: c.APIKey(), Reconnects: 1})
	return r, sb, err
}

func (g *globals) push(ctx context.Context, ref, dir string, opt gitsync.PushOptions) (gitsync.PushResult, error) {
	repo, err := gitsync.Open(ctx, dir)
	if err != nil {
		return gitsync.PushResult{}, usage.Errorf("%v", err)
	}
	r, sb, err := g.dialRef(ctx, ref)
	if err != nil {
		return gitsync.PushResult{}, err
	}
	defer r.Close()
	opt.SandboxID = sb.ID
	start := time.Now()
	prog := g.startProgress("sent")
	opt.Wrap = func(r io.Reader) io.Reader { return progressReader{r, prog} }
	res, err := gitsync.Push(ctx, r, repo, opt)
	prog.end()
	if err != nil {
		return res, stateErr(err)
	}
	if len(res.Submodules) > 0 {
		why := "--rev sends the commit's own files only; push without --rev to send the submodules as they are checked out"
		if opt.Rev == "" {
			why = "the repository has no .gitmodules (they are embedded repositories); register them with git submodule add, or copy them with sbctl cp"
		}
		were := count(len(res.Submodules), "submodule was", "submodules were")
		fmt.Fprintf(g.stderr, "sbctl: warning: %s not pushed (%s): %s\n", were, termSafe(res.Submodules[0]), why)
	}
	if f, ok := g.stderr.(*os.File); ok && isTerminal(f) && !g.quiet && g.output == "table" {
		g.status("pushed in %s\n", time.Since(start).Round(time.Millisecond))
	}
	return res, nil
}

func (g *globals) printPush(res gitsync.PushResult) error {
	if g.quiet {
		return nil
	}
	return g.print(res, func(w io.Writer) {
		what := "the working tree"
		if !res.Synthetic {
			what = "commit"
		}
		fmt.Fprintf(w, "pushed %s %s: %s sent (%s), %d deleted, %d unchanged\n", what, res.Commit[:12], count(res.Sent, "file", "files"), sizeIEC(res.Bytes), res.Deleted, res.Unchanged)
	})
}

// stateErr turns a refusal that protects someone's changes into a conflict (exit code 5).
func stateErr(err error) error {
	var ce *gitsync.ConflictError
	var le *gitsync.LocalChangesError
	if errors.As(err, &ce) || errors.As(err, &le) {
		return &protocol.Error{Code: protocol.CodeInvalidState, Status: 409, Message: err.Error()}
	}
	return err
}

// fetch asks the sandbox for its changes and builds them as a tree of the local repository.
func (g *globals) fetch(ctx context.Context, ref, dir string) (*gitsync.Repo, *gitsync.Fetched, protocol.Sandbox, error) {
	repo, err := gitsync.Open(ctx, dir)
	if err != nil {
		return nil, nil, protocol.Sandbox{}, usage.Errorf("%v", err)
	}
	r, sb, err := g.dialRef(ctx, ref)
	if err != nil {
		return nil, nil, sb, err
	}
	defer r.Close()
	f, err := gitsync.Fetch(ctx, r, repo)
	if err != nil {
		return nil, nil, sb, err
	}
	for _, s := range f.Skipped {
		fmt.Fprintf(g.stderr, "sbctl: warning: the sandbox has a name no git path can be, left out: %s\n", termSafe(s))
	}
	return repo, f, sb, nil
}

func diffCmd(g *globals) *cobra.Command {
	var stat, nameOnly bool
	var dir string
	cmd := outputs(&cobra.Command{
		Use:   "diff REF",
		Short: "Show what changed in a sandbox since the last push, as a git patch",
		Long: `Print the changes made in the sandbox's /workspace since the last sbctl push, as a git patch
against the pushed commit: binary-safe (git apply takes it as is), renames found. --stat and
--name-only print git's summaries instead. Run it in (or with --dir) the repository you pushed from.

` + pushModel + `

Needs the fs:read scope only.`,
		Example: `  sbctl diff dev                  # the patch
  sbctl diff dev --stat
  sbctl diff dev --name-only
  sbctl diff dev > agent.patch && git apply --3way agent.patch`,
		Args: rangeArgs(1, 1, "REF"),
		RunE: func(cmd *cobra.Command, args []string) error {
			repo, f, _, err := g.fetch(cmd.Context(), args[0], dir)
			if err != nil {
				return err
			}
			format := ""
			switch {
			case stat && nameOnly:
				return usage.Errorf("--stat and --name-only are two formats: choose one")
			case stat:
				format = "stat"
			case nameOnly:
				format = "name-only"
			}
			color := false
			if f, ok := g.stdout.(*os.File); ok && isTerminal(f) {
				color = true
			}
			return repo.Diff(cmd.Context(), f, format, color, g.stdout)
		},
	}, "it prints a patch", "table")
	cmd.Flags().BoolVar(&stat, "stat", false, "a diffstat instead of the patch")
	cmd.Flags().BoolVar(&nameOnly, "name-only", false, "only the changed paths")
	cmd.Flags().StringVar(&dir, "dir", ".", "the local repository the sandbox was pushed from")
	return cmd
}

func pullCmd(g *globals) *cobra.Command {
	var branch, dir string
	var force bool
	cmd := outputs(&cobra.Command{
		Use:   "pull REF",
		Short: "Bring the sandbox's changes since the last push into the working tree, or onto a branch",
		Long: `Apply the changes made in the sandbox's /workspace since the last sbctl push to this repository's
working tree (the one you pushed from; --dir to name it).

At each changed path: if your file is still as it was pushed, it becomes the sandbox's version; if
it already is, nothing happens; if you changed it too, a text file is merged three ways (the pushed
version as the base, git merge-file; conflicts get the usual markers) when your version is
committed, and the pull is refused (nothing written) when it is not, unless --force. With --force,
what cannot be merged (binary files, links, a delete against a change) keeps your version and is
listed as a conflict. Your index and HEAD are not touched: the changes show as unstaged.

The base is what was pushed: when you pushed a dirty working tree, that snapshot (your uncommitted
changes of then included), not HEAD.

--branch NAME commits the sandbox's tree on top of the pushed commit as a new local branch instead,
touching no file, and prints how to merge it.

` + pushModel + `

Needs the fs:read scope only.`,
		Example: `  sbctl pull dev                       # into the working tree
  sbctl pull dev --branch agent/dev    # as a branch: then git merge agent/dev
  sbctl pull dev --force               # merge even into files with uncommitted changes`,
		Args: rangeArgs(1, 1, "REF"),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			repo, f, sb, err := g.fetch(ctx, args[0], dir)
			if err != nil {
				return err
			}
			if branch != "" {
				c, err := gitsync.Branch(ctx, repo, f, branch, sb.Name)
				switch {
				case errors.Is(err, gitsync.ErrBadBranchName):
					return usage.Errorf("%v", err)
				case errors.Is(err, gitsync.ErrBranchExists):
					return &protocol.Error{Code: protocol.CodeNameConflict, Status: 409, Message: err.Error()} // exit 5, as a name taken
				case err != nil:
					return err // nothing changed, or git failed: the command line was right
				}
				out := map[string]any{"branch": branch, "commit": c, "base": f.Base, "changes": len(f.Changes)}
				if g.quiet {
					fmt.Fprintln(g.stdout, c)
					return nil
				}
				return g.print(out, func(w io.Writer) {
					fmt.Fprintf(w, "branch %s: %s from sandbox %s, on the pushed commit %s (commit %s)\n", branch, count(len(f.Changes), "changed path", "changed paths"), termSafe(sb.Name), f.Base[:12], c[:12])
					fmt.Fprintf(w, "merge it with:  git merge %s\n", branch)
				})
			}
			res, err := gitsync.Pull(ctx, repo, f, force)
			if err != nil {
				return stateErr(err)
			}
			if err := g.print(res, func(w io.Writer) {
				if g.quiet {
					return
				}
				fmt.Fprintf(w, "%d updated, %d deleted, %d merged, %s, %d already the same\n", len(res.Updated), len(res.Deleted), len(res.Merged), count(len(res.Conflicts), "conflict", "conflicts"), res.Same)
				for _, c := range res.Conflicts {
					fmt.Fprintf(w, "conflict: %s\n", termSafe(c))
				}
			}); err != nil {
				return err
			}
			if len(res.Conflicts) > 0 {
				return silent{&protocol.Error{Code: protocol.CodeInvalidState, Message: "conflicts"}}
			}
			return nil
		},
	}, "it prints what it changed as JSON or YAML, or a summary", "table", "json", "yaml")
	cmd.Flags().StringVar(&branch, "branch", "", "commit the sandbox's changes as this new local branch instead of writing files")
	cmd.Flags().BoolVar(&force, "force", false, "merge into files with uncommitted changes too")
	cmd.Flags().StringVar(&dir, "dir", ".", "the local repository the sandbox was pushed from")
	return cmd
}

// createFrom pushes dir into the sandbox create just made or reused, and prints both.
func (g *globals) createFrom(ctx context.Context, res protocol.CreateSandboxResponse, dir string) error {
	if res.Sandbox.Isolation == protocol.IsolationNone {
		fmt.Fprintf(g.stderr, "sbctl: warning: sandbox %s is not isolated: the broker runs it as a plain directory on its host (the dir provider)\n", termSafe(res.Sandbox.Name))
	}
	pr, err := g.push(ctx, res.Sandbox.ID, dir, gitsync.PushOptions{})
	if err != nil {
		return fmt.Errorf("sandbox %s is %s, but the push failed: %w", res.Sandbox.Name, res.Outcome, err)
	}
	if g.quiet {
		fmt.Fprintln(g.stdout, res.Sandbox.ID)
		return nil
	}
	out := struct {
		protocol.CreateSandboxResponse
		Push gitsync.PushResult `json:"push"`
	}{res, pr}
	return g.print(out, func(w io.Writer) {
		fmt.Fprintf(w, "%s sandbox %s (%s), %s\n", termSafe(res.Outcome), termSafe(res.Sandbox.Name), termSafe(res.Sandbox.ID), statusLine(res.Sandbox))
		fmt.Fprintf(w, "pushed %s: %s sent (%s), %d deleted, %d unchanged\n", pr.Commit[:12], count(pr.Sent, "file", "files"), sizeIEC(pr.Bytes), pr.Deleted, pr.Unchanged)
	})
}
