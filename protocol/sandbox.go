package protocol

import "time"

// Sandbox statuses. A sandbox is born provisioning, runs, may stop (files kept) and resume, may fail
// (its setup command or its runtime could not start), and passes through deleting on its way out.
const (
	StatusProvisioning = "provisioning"
	StatusRunning      = "running"
	StatusStopped      = "stopped"
	StatusFailed       = "failed"
	StatusDeleting     = "deleting"
)

// Statuses lists every status, for validation of list filters.
var Statuses = []string{StatusProvisioning, StatusRunning, StatusStopped, StatusFailed, StatusDeleting}

// Stop reasons recorded on a stopped sandbox.
const (
	StopRequested   = "requested"    // the owner asked (sbctl stop, attach --stop-on-exit)
	StopTTLExpired  = "ttl_expired"  // no heartbeat within ttl_seconds: the sweeper stopped it
	StopRuntimeLost = "runtime_lost" // the sandbox's processes ended without being asked to
	StopMemoryLimit = "memory_limit" // it reached its memory limit: the OOM killer took its init, or memory no process holds (/tmp, /dev/shm) filled it
)

// Isolation levels of a sandbox: how far its commands are kept from the host and from other
// sandboxes.
const (
	// IsolationNamespace: its own mount, pid, ipc, uts, user and network namespaces (bubblewrap),
	// with resource limits where the host enforces them.
	IsolationNamespace = "namespace"
	// IsolationGvisor: a gVisor sandbox (runsc): its commands talk to gVisor's kernel in user space,
	// never to the host's, inside the same namespaces and limits.
	IsolationGvisor = "gvisor"
	// IsolationMicroVM: a virtual machine with its own kernel (designed, not built: it needs /dev/kvm).
	IsolationMicroVM = "microvm"
	// IsolationNone: a plain directory on the host (the dir provider); its commands see the host's
	// files, processes and network.
	IsolationNone = "none"
	// IsolationContainer: a pod's container on a Kubernetes node (the kubernetes provider): its own
	// namespaces and cgroup from the cluster's runtime (runc, or gVisor or Kata through the
	// template's runtime class).
	IsolationContainer = "container"
)

// Create outcomes: what create-or-reuse did.
const (
	OutcomeCreated = "created"
	OutcomeReused  = "reused"
	OutcomeResumed = "resumed"
)

// Sandbox is a sandbox as the REST API shows it.
type Sandbox struct {
	ID       string `json:"id"`
	Org      string `json:"org"`
	Name     string `json:"name"`
	Template string `json:"template"`
	Provider string `json:"provider"`
	// Isolation says how isolated the sandbox is: IsolationNamespace, IsolationGvisor or
	// IsolationNone.
	Isolation       string            `json:"isolation"`
	Status          string            `json:"status"`
	Tags            map[string]string `json:"tags"`
	TTLSeconds      int64             `json:"ttl_seconds"`
	CreatedAt       time.Time         `json:"created_at"`
	LastHeartbeatAt time.Time         `json:"last_heartbeat_at"`
	// ExpiresAt is when the sweeper stops a running sandbox that gets no heartbeat; nil when
	// ttl_seconds is 0 (no lease) or the sandbox is not running.
	ExpiresAt  *time.Time `json:"expires_at"`
	StopReason string     `json:"stop_reason,omitempty"`
	StoppedAt  *time.Time `json:"stopped_at,omitempty"`
	// Failure says why a failed sandbox failed (for a setup command: its exit code and output tail).
	Failure   string `json:"failure,omitempty"`
	CreatedBy string `json:"created_by"`
	// Workspace is the sandbox path of the workspace directory, the default cwd for exec.
	Workspace string `json:"workspace"`
	// ProcessesLostAt is set when the broker restarted under a running sandbox: its files are intact,
	// its processes (background servers included) are gone and were not restarted.
	ProcessesLostAt *time.Time `json:"processes_lost_at,omitempty"`
	// NodeStatus is NodeLost when the broker hosting the sandbox stopped renewing its liveness
	// record and another broker declared it lost (absent otherwise). Status is then the last state
	// the record knew: nothing can reach the sandbox's processes or files until that broker is
	// back. NodeLostAt says since when.
	NodeStatus string     `json:"node_status,omitempty"`
	NodeLostAt *time.Time `json:"node_lost_at,omitempty"`
	// DataplaneURL is the sandbox's dataplane on the broker hosting it (create, list, get, stop, resume):
	// an owner's client dials it there, since any other broker answers wrong_node.
	DataplaneURL string `json:"dataplane_url,omitempty"`
	// Placement says where a running sandbox of a provider that places sandboxes elsewhere runs
	// (the kubernetes provider: its cluster node and pod); absent otherwise.
	Placement *Placement `json:"placement,omitempty"`
}

// Placement is where a sandbox runs outside the broker's host.
type Placement struct {
	// Node is the cluster node running the sandbox.
	Node string `json:"node,omitempty"`
	// Pod is the sandbox's pod, namespace/name.
	Pod string `json:"pod,omitempty"`
}

// NodeLost is the node_status of a sandbox whose hosting broker was declared lost.
const NodeLost = "lost"

// CreateSandboxRequest is the body of POST /v1/sandboxes.
type CreateSandboxRequest struct {
	Name     string `json:"name,omitempty"`
	Template string `json:"template,omitempty"`
	// TTLSeconds is the lease: no heartbeat for this long and the sandbox is stopped. Nil means the
	// broker's default; 0 means no lease (the sandbox runs until stopped).
	TTLSeconds *int64            `json:"ttl_seconds,omitempty"`
	Tags       map[string]string `json:"tags,omitempty"`
	// Reuse (default true) returns an existing sandbox of the same name instead of failing with
	// name_conflict; a stopped one is resumed.
	Reuse *bool `json:"reuse,omitempty"`
	// Isolation asks for a level (IsolationNamespace, IsolationGvisor) instead of the template's;
	// empty means the template's. It may raise the template's level, never lower it, and a level the
	// host cannot give is refused (isolation_unavailable), never replaced by a weaker one.
	Isolation string `json:"isolation,omitempty"`
}

// CreateSandboxResponse says what create-or-reuse did.
type CreateSandboxResponse struct {
	Outcome string  `json:"outcome"`
	Sandbox Sandbox `json:"sandbox"`
}

// ListSandboxesResponse is one page of GET /v1/sandboxes.
type ListSandboxesResponse struct {
	Items []Sandbox `json:"items"`
	// NextCursor is empty on the last page.
	NextCursor string `json:"next_cursor,omitempty"`
}

// TTLRequest is the body of POST /v1/sandboxes/{ref}/ttl.
type TTLRequest struct {
	TTLSeconds *int64 `json:"ttl_seconds"`
}

// HeartbeatResponse is the answer to POST /v1/sandboxes/{ref}/heartbeat; small on purpose, it is the
// hottest route.
type HeartbeatResponse struct {
	SandboxID  string     `json:"sandbox_id"`
	Status     string     `json:"status"`
	TTLSeconds int64      `json:"ttl_seconds"`
	ExpiresAt  *time.Time `json:"expires_at"`
	// NodeStatus is NodeLost when the hosting broker was declared lost (see Sandbox.NodeStatus).
	NodeStatus string `json:"node_status,omitempty"`
}

// DeleteSandboxesResponse answers DELETE /v1/sandboxes?tag=k=v (and DELETE of one sandbox).
type DeleteSandboxesResponse struct {
	DryRun  bool      `json:"dry_run"`
	Deleted []Sandbox `json:"deleted"`
}

// EnvironmentResponse is GET /v1/sandboxes/{ref}/environment: what printenv shows inside.
type EnvironmentResponse struct {
	SandboxID string            `json:"sandbox_id"`
	Env       map[string]string `json:"env"`
}

// Orphan is a sandbox that looks abandoned, with every reason why.
type Orphan struct {
	Sandbox Sandbox  `json:"sandbox"`
	Reasons []string `json:"reasons"`
}

// OrphansResponse is GET /v1/orphans: the sweep's dry run.
type OrphansResponse struct {
	Items []Orphan `json:"items"`
}

// HeartbeatsRequest is the body of POST /v1/heartbeats: renew many leases in one request.
type HeartbeatsRequest struct {
	Refs []string `json:"refs"`
}

// HeartbeatsResponse answers each ref in order: its lease, or its own error.
type HeartbeatsResponse struct {
	Items []HeartbeatItem `json:"items"`
}

// HeartbeatItem is one ref's answer in a batch.
type HeartbeatItem struct {
	Ref   string             `json:"ref"`
	Lease *HeartbeatResponse `json:"lease,omitempty"`
	Error *Error             `json:"error,omitempty"`
}
