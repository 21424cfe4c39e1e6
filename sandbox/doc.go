// Package sandbox is the sandbox lifecycle: it keeps the records in the store and the runtimes on
// this broker (providers, workspaces) in step. Create-or-reuse, stop, resume, delete, heartbeats,
// recovery after a broker restart and commands to the broker that hosts a sandbox all pass here, so
// the HTTP server and the sweeper share one implementation.
//
// Runtimes live in sandbox/provider, file operations in sandbox/workspace. This package must not
// know HTTP or tokens.
package sandbox
