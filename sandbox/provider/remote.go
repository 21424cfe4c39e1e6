package provider

import (
	"context"
	"time"
)

// Remote is a provider whose sandboxes do not live on the broker's host (a pod of the kubernetes
// provider): their workspace is no directory here, their instances serve files themselves (the
// manager's Runtime asks the instance for them), and the manager neither opens nor sweeps a
// workspace directory for them. WorkspaceDir answers "".
type Remote interface {
	Provider
	// RemoteWorkspace marks the provider.
	RemoteWorkspace()
}

// IsRemote says whether p's sandboxes live elsewhere.
func IsRemote(p Provider) bool {
	_, ok := p.(Remote)
	return ok
}

// PrepareExec checks a request as every provider's Exec does and returns what a remote init needs:
// the argv (a Command runs as /bin/sh -c), the environment overrides as KEY=VALUE, the sandbox cwd
// (WorkspacePath when empty) and the timeout to enforce under the template's limits over the
// built-in defaults. A request the sandbox cannot run is an *InvalidRequestError.
func PrepareExec(req ExecRequest, limits Limits) (argv, env []string, cwd string, timeout time.Duration, err error) {
	if argv, err = execArgv(req); err != nil {
		return
	}
	if cwd, err = sandboxCwd(req.Cwd); err != nil {
		return
	}
	if env, err = envOverrides(req.Env); err != nil {
		return
	}
	if req.Timeout < 0 {
		err = invalidRequest("negative timeout")
		return
	}
	l := resolveLimits(Limits{}, limits)
	timeout = req.Timeout
	if timeout == 0 {
		timeout = time.Duration(l.ExecTimeout)
	}
	timeout = min(timeout, time.Duration(l.ExecTimeoutMax))
	return
}

// KubernetesTemplate is a template's pod for the kubernetes provider: what the cluster adds to the
// template's env, limits and network. Every field is optional.
type KubernetesTemplate struct {
	// Image is the sandbox image (default: the broker's --kube-image); its entrypoint must run
	// sbx-agent (cmd/sbx-agent).
	Image string `json:"image,omitempty"`
	// ImagePullPolicy is Always, IfNotPresent or Never (default: the broker's --kube-pull-policy).
	ImagePullPolicy string `json:"image_pull_policy,omitempty"`
	// RuntimeClassName runs the pod under a runtime class the cluster has (gVisor, Kata).
	RuntimeClassName string `json:"runtime_class_name,omitempty"`
	// NodeSelector places the pod on nodes with these labels.
	NodeSelector map[string]string `json:"node_selector,omitempty"`
	// Tolerations let the pod onto tainted nodes.
	Tolerations []KubernetesToleration `json:"tolerations,omitempty"`
	// CPURequest and MemoryRequest are the container's requests (quantities such as "250m",
	// "256Mi"); the limits come from the template's limits (cpus, memory_bytes). Default: the limits.
	CPURequest    string `json:"cpu_request,omitempty"`
	MemoryRequest string `json:"memory_request,omitempty"`
}

// KubernetesToleration is a pod toleration.
type KubernetesToleration struct {
	Key               string `json:"key,omitempty"`
	Operator          string `json:"operator,omitempty"` // Exists or Equal (default)
	Value             string `json:"value,omitempty"`
	Effect            string `json:"effect,omitempty"` // NoSchedule, PreferNoSchedule, NoExecute, or all
	TolerationSeconds *int64 `json:"toleration_seconds,omitempty"`
}

// Reconciler is a provider whose runtimes can outlive what the broker knows of them (pods on a
// cluster): it lists them, so that the manager's periodic reconcile ends those no record wants.
type Reconciler interface {
	// Runtimes lists the sandboxes this broker has a runtime for.
	Runtimes(ctx context.Context) ([]RuntimeRef, error)
	// EndRuntime ends a sandbox's runtime (its files stay).
	EndRuntime(ctx context.Context, id string) error
}

// RuntimeRef names a sandbox's runtime: its id and org.
type RuntimeRef struct {
	ID, Org string
}

// Claimer is a provider whose runtimes name their owner (the kubernetes provider labels a pod and
// the objects made for it with the org and the sandbox's name, which its Reconciler matches to
// records). A warm pool's sandbox is created and started with no owner (Spec.Org and Name empty);
// when a create claims it, the manager calls Claimed with the full spec before the sandbox is
// running, so that from then on it is found as the org's.
type Claimer interface {
	Claimed(ctx context.Context, spec Spec) error
	// Unclaimed lists the sandboxes this broker has a runtime for that name no owner: its warm
	// pool's. At a broker's start, before its pool fills, any of them its index does not list was
	// left by an earlier broker that lost its data dir.
	Unclaimed(ctx context.Context) ([]string, error)
}

// Outliving is a provider whose instances live on without the broker's process: a pod, its agent
// and the commands it runs keep running when the broker that made it exits. A broker that stops
// lets go of them (Detach) instead of ending them, and its next start takes each back (Adopt)
// instead of starting it again, so that a restart or a rolling update loses none of a sandbox's
// processes. The namespace and dir providers are not: their inits are the broker's own children
// and end with it, so a restarted broker starts them afresh (and the record says the processes
// were lost).
type Outliving interface {
	Provider
	// Adopt takes back the running instance of spec's sandbox that an earlier run of this broker
	// left, when it is still the one the provider made, up, and proves itself as the sandbox's own
	// (the kubernetes provider: same labels, Ready, its agent passing the sandbox's TLS pin and
	// secret). Otherwise it says why not in a *NotAdoptedError, having ended what was left of it
	// so that Start makes a new one; any other error (the cluster did not answer) ended nothing.
	Adopt(ctx context.Context, spec Spec) (Instance, error)
	// Detach lets go of inst without ending its processes: the provider stops watching it and
	// closes its connections, and its Done closes. inst is not used again.
	Detach(inst Instance)
}

// NotAdoptedError says why a sandbox's runtime left by an earlier broker could not be taken back
// (gone, not ready, not the one made for it, or its agent did not prove itself).
type NotAdoptedError struct{ Reason string }

func (e *NotAdoptedError) Error() string { return "not taken back: " + e.Reason }
