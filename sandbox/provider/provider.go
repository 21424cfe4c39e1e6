package provider

import (
	"context"
	"io"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// Provider turns a template into a running sandbox on this host. Two exist: "namespace" (bubblewrap,
// isolated) and "dir" (a plain directory, no isolation). Both keep the workspace on the host's disk,
// so file operations run in the broker through the workspace package, not through exec.
//
// The lifecycle is: Create once (prepare persistent state), Start / Instance.Stop any number of times
// (files stay), Destroy once (remove everything). A Provider is safe for concurrent use on different
// sandboxes; the caller serializes calls for one sandbox.
type Provider interface {
	// Name is "namespace" or "dir"; it is recorded on each sandbox.
	Name() string
	// Create prepares the sandbox's persistent state: its workspace directory (empty, owned by the
	// sandbox user) and its state directory. It is idempotent.
	Create(ctx context.Context, spec Spec) error
	// Start starts the sandbox's resident init and returns once the sandbox can exec. It captures the
	// environment snapshot before it returns.
	Start(ctx context.Context, spec Spec) (Instance, error)
	// Destroy removes the workspace and state directories. The sandbox must not be running.
	Destroy(ctx context.Context, spec Spec) error
	// WorkspaceDir is the host directory that holds the sandbox's /workspace.
	WorkspaceDir(spec Spec) string
}

// Spec names one sandbox for a provider.
type Spec struct {
	// ID is the sandbox id (sb_...). Providers name host resources (directories, cgroups) after it.
	ID string
	// Org and Name are the sandbox's owner and name, for providers that label what they make
	// (the kubernetes provider's pods); empty where the caller does not know them.
	Org, Name string
	Template  Template
	// UID is the host uid, and gid, the sandbox runs as and its workspace belongs to when the broker
	// is root: its own, from the broker's range. 0 means Config.UID, the uid sandboxes shared
	// before each got its own. It is ignored when the broker is not root.
	UID int
}

// Instance is one running sandbox: a resident init inside the sandbox's namespaces that forks
// commands on request.
type Instance interface {
	// Exec runs one command and returns when it has exited (or, for Background, once it started).
	// Errors are for the request itself (bad cwd, init gone); a command that runs and fails is a
	// result with a non-zero ExitCode.
	Exec(ctx context.Context, req ExecRequest) (ExecResult, error)
	// Environment is the snapshot of what printenv shows inside, captured at Start.
	Environment() map[string]string
	// Stop ends every process in the sandbox (background ones included) and waits for them. Files stay.
	Stop(ctx context.Context) error
	// Done is closed when the init exits, whether through Stop or not (a crash, the limit killer).
	Done() <-chan struct{}
}

// WorkspacePath is the sandbox path of the workspace: the default cwd of exec and the root of every
// file operation path.
const WorkspacePath = protocol.WorkspaceRoot

// ExecRequest is one command. Exactly one of Command and Argv is set.
type ExecRequest struct {
	// Command is a shell string, run as /bin/sh -c Command.
	Command string
	// Argv is a program and its arguments, run without a shell; Argv[0] is looked up in PATH.
	Argv []string
	// Cwd is a sandbox path; empty means WorkspacePath.
	Cwd string
	// Env is added to (and overrides) the sandbox environment.
	Env map[string]string
	// Stdin feeds the command's standard input; nil means an empty one. Once the command has
	// ended, Exec waits up to a second for a Read on Stdin that is still blocked, then abandons it.
	Stdin io.Reader
	// Stdout and Stderr receive output as it comes. When Stderr is nil, stderr goes to Stdout through
	// the same pipe, interleaved as the command wrote it. A nil Stdout discards output.
	Stdout io.Writer
	Stderr io.Writer
	// MaxOutput caps the bytes delivered to Stdout and Stderr together; past it output is read and
	// dropped (the command is not blocked) and the result says Truncated. 0 means no cap.
	MaxOutput int64
	// Timeout kills the command's whole process tree when it passes; 0 means the template's default.
	// It is capped by the template's maximum.
	Timeout time.Duration
	// Background starts the command and returns at once with its pid; it runs until it exits or the
	// sandbox stops, with its output discarded.
	Background bool
	// TTY, when set, runs the command on a pseudo-terminal that the init allocates inside the
	// sandbox, from the sandbox's own devpts: Stdin is typed into it, everything the command writes
	// to it goes to Stdout (Stderr must be nil), and the command leads a new session with it as its
	// controlling terminal, so ^C and ^Z typed are signals to its foreground job. Timeout 0 means
	// none (the caller's ctx bounds it). When the command ends, so does the rest of its session;
	// when ctx ends, the whole session is killed. The end of Stdin is typed as the terminal's
	// end-of-file character (^D). Exec does not wait for a Stdin Read still blocked when the command
	// ended: the caller ends its reader. Providers that cannot do it say so (SupportsTTY).
	TTY *TTY
	// Started, when set, is called once, on Exec's goroutine, before Exec first waits for anything
	// (the command's end, the sandbox taking the request): a caller that runs Exec where nothing
	// may wait long (a dataplane connection's reader) moves its other work elsewhere then. Exec may
	// return without calling it, having waited for nothing (a request it refused).
	Started func()
}

// CallsStarted reports whether inst calls ExecRequest.Started itself, as late as it may (once its
// request is on its way to the sandbox); for any other, the caller calls it before Exec.
func CallsStarted(inst Instance) bool {
	_, ok := inst.(interface{ callsStarted() })
	return ok
}

// TTY is a terminal's window and its changes.
type TTY struct {
	// Rows and Cols are the window at the start; 0 means 24 rows, 80 columns.
	Rows, Cols uint16
	// Resize, when set, delivers new window sizes while the command runs; the foreground job gets
	// SIGWINCH.
	Resize <-chan WindowSize
}

// WindowSize is a terminal's size in character cells.
type WindowSize struct{ Rows, Cols uint16 }

// SupportsTTY reports whether inst runs commands on a terminal (ExecRequest.TTY).
// A provider outside this package says so with a SupportsTTY method (the kubernetes provider's pods).
func SupportsTTY(inst Instance) bool {
	if _, ok := inst.(interface{ runsTTY() }); ok {
		return true
	}
	s, ok := inst.(interface{ SupportsTTY() bool })
	return ok && s.SupportsTTY()
}

// ExecResult is how a command ended.
type ExecResult struct {
	// ExitCode is the command's exit status, or 128+signal when a signal ended it (as a shell reports).
	ExitCode int
	// Signal names the signal that ended the command ("KILL", "SEGV"), empty if it exited.
	Signal string
	// Reason says why the broker or the kernel ended the command, empty when it ended on its own:
	// "timeout", "cancelled", "memory_limit".
	Reason    string
	Truncated bool
	Duration  time.Duration
	// Pid is the command's pid inside the sandbox (set for Background).
	Pid int
}

// Reasons a command was ended from outside (the protocol's, so every exec says them alike).
const (
	ReasonTimeout     = protocol.ExecReasonTimeout
	ReasonCancelled   = protocol.ExecReasonCancelled
	ReasonMemoryLimit = protocol.ExecReasonMemoryLimit
)

// Template is what a sandbox is made from. Templates come from the broker's --templates file and a
// built-in "default".
type Template struct {
	Name string `json:"name"`
	// Rootfs is a host directory mounted read-only as /; empty means the host's /usr (with the usual
	// /bin, /lib links) and a minimal /etc.
	Rootfs string `json:"rootfs,omitempty"`
	// Mounts are extra read-only host directories (a knowledge base, a toolchain).
	Mounts []Mount `json:"mounts,omitempty"`
	// Env is added to every command's environment.
	Env map[string]string `json:"env,omitempty"`
	// Network is the sandbox's egress: none (false, the default: a private loopback only), any
	// destination (true), or only the destinations listed ({allow: [...]}). The sandbox never shares
	// the host's network namespace (network.go).
	Network Network `json:"network,omitzero"`
	Limits  Limits  `json:"limits,omitempty"`
	// Disk is the size of the workspace's own filesystem (namespace provider run as root; see
	// volume.go): "2GiB", "512MiB". 0 means DefaultDisk. Inodes come with it, one per 16 KiB.
	Disk ByteSize `json:"disk,omitempty"`
	// Tmp is the size of /tmp and of /dev/shm, each; 0 means a quarter of the memory limit.
	Tmp ByteSize `json:"tmp,omitempty"`
	// Setup is a shell command run once at create, in the workspace; a non-zero exit marks the sandbox
	// failed with the command's output.
	Setup string `json:"setup,omitempty"`
	// Isolation is the level the sandbox runs at: "namespace" (empty: the default; bubblewrap) or
	// "gvisor" (runsc: gVisor's kernel between the sandbox and the host's). "microvm" is recognised
	// and refused: it needs /dev/kvm and a microVM runtime. A level the host cannot give is refused
	// at create, never replaced by a weaker one (gvisor.go).
	Isolation string `json:"isolation,omitempty"`
	// Pool keeps sandboxes of this template started and set up ahead of demand on each broker, so
	// that a create claims one instead of starting one (sandbox/pool.go).
	Pool Pool `json:"pool,omitzero"`
	// Kubernetes is how the kubernetes provider makes the sandbox's pod (remote.go); other providers
	// ignore it.
	Kubernetes *KubernetesTemplate `json:"kubernetes,omitempty"`
}

// Pool is a template's warm pool: Size sandboxes started, set up, and kept ready on each broker.
type Pool struct {
	// Size is how many are kept ready; 0 (the default) keeps none. At most MaxPoolSize.
	Size int `json:"size,omitempty"`
}

// MaxPoolSize bounds a template's pool: each pooled sandbox holds a host uid, its processes (about
// 2 MB of host memory) and its workspace image while it waits.
const MaxPoolSize = 32

// Mount is a read-only bind of a host directory into the sandbox.
type Mount struct {
	Source string `json:"source"`
	Target string `json:"target"`
}

// Limits bound what a sandbox may use. Zero values mean the broker's defaults.
type Limits struct {
	MemoryBytes int64   `json:"memory_bytes,omitempty"`
	Pids        int64   `json:"pids,omitempty"`
	CPUs        float64 `json:"cpus,omitempty"`
	// ExecTimeout is the default per-command timeout, ExecTimeoutMax the largest a caller may ask for.
	ExecTimeout    Duration `json:"exec_timeout,omitempty"`
	ExecTimeoutMax Duration `json:"exec_timeout_max,omitempty"`
}

// Duration is a time.Duration that reads and writes as a Go duration string ("30s", "10m") in
// template files.
type Duration time.Duration

// EndReason says why an instance ended without a Stop, once its Done is closed: ReasonMemoryLimit
// when the memory limit's OOM killer took its init, "" for anything else (a crash, a kill from the
// host).
func EndReason(inst Instance) string {
	if r, ok := inst.(interface{ endReason() string }); ok {
		return r.endReason()
	}
	if r, ok := inst.(interface{ EndReason() string }); ok { // a provider outside this package
		return r.EndReason()
	}
	return ""
}

// EndMessage says in a person's words why an instance ended without a Stop (for a pod: deleted,
// evicted, its container's exit, with the cluster's own reason), once its Done is closed; "" when
// the provider cannot tell more than the stop reason does.
func EndMessage(inst Instance) string {
	if r, ok := inst.(interface{ EndMessage() string }); ok {
		return r.EndMessage()
	}
	return ""
}
