// Package provider owns the host side of sandboxes: the two runtimes that turn a template into a
// running sandbox ("namespace" on bubblewrap, "dir" without isolation), the broker's end of the
// resident init that runs inside every sandbox and forks commands on request (the init itself is the
// leaf package sbxinit), the per-sandbox cgroups that enforce limits, template files, and the
// preflight that picks a runtime for this host.
//
// On disk a provider owns <Config.DataDir>/sandboxes/<id>/{workspace,state} and nothing else; in the
// cgroup hierarchies it owns <mount>/<Config.CgroupParent>/<id>. It must not touch anything outside
// those: it does not know about owners, tokens, Redis or the HTTP API (the sandbox manager above it
// does), and it never reads or writes workspace files on behalf of callers (file operations go through
// the workspace package on WorkspaceDir, not through exec).
//
// # The resident init
//
// The init (package sbxinit) is Config.InitPath run with the single argument InitArg: cmd/sbx-init, a
// small static binary, or the broker's own executable. Every main that may start sandboxes must
// dispatch it before doing anything else:
//
//	if len(os.Args) > 1 && os.Args[1] == provider.InitArg {
//		provider.RunInit()
//	}
//
// The broker and the init talk over a SOCK_SEQPACKET socketpair (fd 3 in the init). An exec request
// carries the command's stdio as file descriptors (SCM_RIGHTS): the broker owns the pipes and reads
// them through Go's poller, the init only dup2s them into the child, so output never passes through
// the init. The init reports each command's exit; one goroutine in the broker demultiplexes replies.
//
// The init runs inside the sandbox with the sandbox user's rights, so the broker treats everything it
// says as untrusted input that can only affect that same sandbox.
package provider
