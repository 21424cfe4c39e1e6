// Package workspace owns the file operations the broker serves on a sandbox's workspace: the host
// directory that processes inside the sandbox see as /workspace. The dataplane (for remote agents)
// and backend.Local (on a developer's own machine) both call it, so they answer alike, with
// *protocol.Error values whose messages name sandbox paths only.
//
// Callers are untrusted and so is the tree itself: processes in the sandbox can plant symlinks to
// anywhere, FIFOs, huge or binary files, and change the tree while an operation runs. The package
// must therefore never follow a path out of the workspace. Every path is cleaned lexically by
// [Resolve] and then resolved only through an [os.Root], which refuses any symlink (absolute, or
// relative and leading out) that would leave the workspace; non-regular files are never opened for
// reading; and a host path never appears in a result or an error.
//
// Writes are atomic: content goes to a temporary file (".sbx-tmp-<random>") next to the target,
// which is then renamed over it, so a reader sees the old file or the new one, never half of one.
// Temporary files are the broker's: ls, glob and grep leave them out, every failed or cut write
// removes its own, and [Workspace.SweepTemps] removes those a dead broker left.
//
// The package does not touch anything outside the workspace directory it was opened on, and it does
// not decide who may call it: authorization happens before a call reaches it.
package workspace
