// Package kube is the kubernetes provider: each sandbox is one pod on a cluster, its workspace a
// PersistentVolumeClaim, its commands and files served by the resident init running in the pod
// (sbx-agent (cmd/sbx-agent), sandbox/provider/agent) and reached over the pod network with a per-sandbox
// secret the broker holds. Nothing above the runtime handle (sandbox.Runtime) knows a sandbox is a
// pod: exec and files go through the agent, never through the API server or `kubectl exec`.
//
// Mapping of the lifecycle (names from the sandbox id, sb_<uuid> → sbx-<uuid>):
//
//   - Create: a Secret holding the agent's secret, the workspace's claim (the template's disk size,
//     the configured storage class) and, when the cluster enforces them, a NetworkPolicy that
//     admits only the agent's port and denies egress unless the template allows the network.
//     Existing objects are reused (AlreadyExists is not an error): create is idempotent.
//   - Start: the pod (AlreadyExists = reuse the running one), then a watch until it runs, then the
//     agent's greeting. A pod that cannot start (image missing, unschedulable, a bad runtime class)
//     fails the start with the cluster's reason and is deleted.
//   - Instance.Stop: the pod is deleted, the claim kept (files survive); a resume starts a new pod
//     on the same claim.
//   - Destroy: the pod, the claim, the NetworkPolicy and the Secret.
//
// Every object carries the labels LabelManaged, LabelBroker, LabelID, LabelOrg and LabelName, so
// pods and records can be matched after a restart (Orphans).
package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
)

// Name is the provider's name, recorded on each sandbox.
const Name = "kubernetes"

// Labels on every object the provider makes.
const (
	LabelManaged = "sbx.dev/managed-by" // = "sbx-broker"
	LabelBroker  = "sbx.dev/broker"     // the broker's node name
	LabelID      = "sbx.dev/sandbox"    // the sandbox id's uuid part
	LabelOrg     = "sbx.dev/org"
	LabelName    = "sbx.dev/name"
	managedBy    = "sbx-broker"
)

// Config wires the provider.
type Config struct {
	Client    kubernetes.Interface
	Namespace string
	// Broker is this broker's node name (the LabelBroker label).
	Broker string
	// Image is the sandbox image when the template names none: it must run sbx-agent (cmd/sbx-agent) as its
	// entrypoint (or command) and hold /bin/sh.
	Image string
	// PullPolicy is the image pull policy when the template says none ("" = IfNotPresent).
	PullPolicy corev1.PullPolicy
	// StorageClass is the workspace claims' class; "" uses the cluster's default class.
	StorageClass string
	// NetworkPolicies makes a NetworkPolicy per sandbox (effective only where the CNI enforces them).
	NetworkPolicies bool
	// AgentFrom are the peers the NetworkPolicy admits to the agent's port: the brokers (ParseAgentFrom).
	// Empty admits any source; the agent still authenticates every connection and bounds the
	// connections that have not (agent.MaxPendingHandshakes).
	AgentFrom []networkingv1.NetworkPolicyPeer
	// StartTimeout bounds a start (scheduling, image, the agent's greeting); 0 means 2 minutes.
	StartTimeout time.Duration
	Log          *slog.Logger
}

// Provider places sandboxes as pods.
type Provider struct {
	cfg Config
}

var (
	_ provider.Remote     = (*Provider)(nil)
	_ provider.Reconciler = (*Provider)(nil)
	_ provider.Claimer    = (*Provider)(nil)
)

// New checks the configuration and that the namespace is reachable.
func New(ctx context.Context, cfg Config) (*Provider, error) {
	if cfg.Client == nil || cfg.Namespace == "" {
		return nil, errors.New("kubernetes provider: a client and a namespace are required")
	}
	if cfg.Image == "" {
		return nil, errors.New("kubernetes provider: a sandbox image is required (--kube-image): one whose entrypoint is sbx-agent (cmd/sbx-agent)")
	}
	if cfg.StartTimeout == 0 {
		cfg.StartTimeout = 2 * time.Minute
	}
	if cfg.PullPolicy == "" {
		cfg.PullPolicy = corev1.PullIfNotPresent
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if _, err := cfg.Client.CoreV1().Namespaces().Get(ctx, cfg.Namespace, metav1.GetOptions{}); err != nil && !apierrors.IsForbidden(err) {
		return nil, fmt.Errorf("kubernetes provider: namespace %s: %w", cfg.Namespace, err)
	}
	return &Provider{cfg: cfg}, nil
}

// Name is "kubernetes".
func (p *Provider) Name() string { return Name }

// RemoteWorkspace marks the workspace as not on this host.
func (p *Provider) RemoteWorkspace() {}

// WorkspaceDir is "": the workspace is a claim in the cluster.
func (p *Provider) WorkspaceDir(provider.Spec) string { return "" }

// PodName is the pod (and claim, secret, policy) name of a sandbox.
func PodName(id string) string {
	return "sbx-" + strings.ToLower(strings.TrimPrefix(id, protocol.SandboxIDPrefix))
}

func (p *Provider) labels(spec provider.Spec) map[string]string {
	l := map[string]string{
		LabelManaged: managedBy,
		LabelBroker:  labelValue(p.cfg.Broker),
		LabelID:      strings.TrimPrefix(PodName(spec.ID), "sbx-"),
	}
	if spec.Org != "" {
		l[LabelOrg] = labelValue(spec.Org)
	}
	if spec.Name != "" {
		l[LabelName] = labelValue(spec.Name)
	}
	return l
}

// annotationOrg holds the org exactly (a label value may have had to change it).
const annotationOrg = "sbx.dev/org"

// labelValue makes s a valid label value (63 characters of [A-Za-z0-9._-], alphanumeric ends).
func labelValue(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			b[i] = '_'
		}
	}
	s = strings.Trim(string(b[:min(len(b), 63)]), "._-")
	return s
}

func (p *Provider) meta(spec provider.Spec) metav1.ObjectMeta {
	m := metav1.ObjectMeta{Name: PodName(spec.ID), Namespace: p.cfg.Namespace, Labels: p.labels(spec)}
	if spec.Org != "" {
		m.Annotations = map[string]string{annotationOrg: spec.Org}
	}
	return m
}

// Claimed names the owner of a sandbox made for the broker's warm pool, which a create has just
// claimed: its pod, secret, claim and network policy get the org and name labels and the org
// annotation (provider.Claimer), so that Runtimes lists its pod under the org and the reconcile
// matches it to its record (a pooled pod has no org: Runtimes never lists it, so the reconcile
// never ends it). The four patches run at once; an object not there (a pod not started yet, no
// network policy) is skipped.
func (p *Provider) Claimed(ctx context.Context, spec provider.Spec) error {
	// A create waits on this: an API server that does not answer must not hold it for long (the
	// labels are set again at the sandbox's next start).
	ctx, cancel := context.WithTimeout(ctx, claimTimeout)
	defer cancel()
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"labels": p.labels(spec), "annotations": map[string]string{annotationOrg: spec.Org}}})
	if err != nil {
		return err
	}
	c, ns, name := p.cfg.Client, p.cfg.Namespace, PodName(spec.ID)
	opts := metav1.PatchOptions{}
	patches := []func() error{
		func() error {
			_, err := c.CoreV1().Pods(ns).Patch(ctx, name, types.MergePatchType, patch, opts)
			return err
		},
		func() error {
			_, err := c.CoreV1().Secrets(ns).Patch(ctx, name, types.MergePatchType, patch, opts)
			return err
		},
		func() error {
			_, err := c.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, name, types.MergePatchType, patch, opts)
			return err
		},
	}
	if p.cfg.NetworkPolicies {
		patches = append(patches, func() error {
			_, err := c.NetworkingV1().NetworkPolicies(ns).Patch(ctx, name, types.MergePatchType, patch, opts)
			return err
		})
	}
	errs := make([]error, len(patches))
	var wg sync.WaitGroup
	for i, f := range patches {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(); err != nil && !apierrors.IsNotFound(err) {
				errs[i] = err
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("labelling sandbox %s's objects with its owner: %w", name, err)
	}
	return nil
}

// claimTimeout bounds Claimed's patches.
const claimTimeout = 10 * time.Second

// Runtimes lists the sandboxes this broker has pods for (provider.Reconciler).
func (p *Provider) Runtimes(ctx context.Context) ([]provider.RuntimeRef, error) {
	pods, err := p.cfg.Client.CoreV1().Pods(p.cfg.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: LabelManaged + "=" + managedBy + "," + LabelBroker + "=" + labelValue(p.cfg.Broker),
	})
	if err != nil {
		return nil, err
	}
	var out []provider.RuntimeRef
	for _, pod := range pods.Items {
		if id := pod.Labels[LabelID]; id != "" && pod.Annotations[annotationOrg] != "" {
			out = append(out, provider.RuntimeRef{ID: protocol.SandboxIDPrefix + id, Org: pod.Annotations[annotationOrg]})
		}
	}
	return out, nil
}

// Unclaimed lists the sandboxes this broker has pods for that name no org: its warm pool's
// (provider.Claimer).
//
// It runs at the broker's start (sandbox's recoverUnclaimed) with no deadline of its own, so it
// is held to cleanupTimeout: a throttling API server is retried for as long as the context lasts
// (throttle.go), and must not hold the broker's start for as long as the throttling does.
func (p *Provider) Unclaimed(ctx context.Context) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
	defer cancel()
	pods, err := p.cfg.Client.CoreV1().Pods(p.cfg.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: LabelManaged + "=" + managedBy + "," + LabelBroker + "=" + labelValue(p.cfg.Broker),
	})
	if err != nil {
		return nil, err
	}
	var out []string
	for _, pod := range pods.Items {
		if id := pod.Labels[LabelID]; id != "" && pod.Annotations[annotationOrg] == "" {
			out = append(out, protocol.SandboxIDPrefix+id)
		}
	}
	return out, nil
}

// EndRuntime deletes a sandbox's pod; its claim stays (provider.Reconciler). Within cleanupTimeout:
// the broker's start ends pods left unclaimed with no deadline of its own (recoverUnclaimed).
func (p *Provider) EndRuntime(ctx context.Context, id string) error {
	ctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
	defer cancel()
	return p.deletePod(ctx, PodName(id), 0)
}

// Create makes the sandbox's Secret, claim and NetworkPolicy; existing ones are kept.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) error {
	c := p.cfg.Client
	ns := p.cfg.Namespace
	if err := p.createSecret(ctx, spec); err != nil {
		return err
	}
	size := spec.Template.Disk
	if size == 0 {
		size = provider.DefaultDisk
	}
	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: p.meta(spec),
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceStorage: *resource.NewQuantity(int64(size), resource.BinarySI)}},
		},
	}
	if p.cfg.StorageClass != "" {
		claim.Spec.StorageClassName = &p.cfg.StorageClass
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("the workspace's claim: %w", err)
	}
	if p.cfg.NetworkPolicies {
		np, err := p.networkPolicy(spec)
		if err != nil {
			return err
		}
		if _, err := c.NetworkingV1().NetworkPolicies(ns).Create(ctx, np, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("the sandbox's network policy: %w", err)
		}
	}
	return nil
}

// networkPolicy admits only the agent's port, from the brokers (Config.AgentFrom), and denies egress
// unless the template turns the network on (an allowlist becomes its CIDRs; names cannot be
// expressed and are refused).
func (p *Provider) networkPolicy(spec provider.Spec) (*networkingv1.NetworkPolicy, error) {
	port := intstr.FromInt32(agent.Port)
	tcp := corev1.ProtocolTCP
	np := &networkingv1.NetworkPolicy{
		ObjectMeta: p.meta(spec),
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{LabelID: p.labels(spec)[LabelID]}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}},
				From:  p.cfg.AgentFrom,
			}},
		},
	}
	if spec.Template.Network.Enabled {
		if len(spec.Template.Network.Allow) == 0 {
			np.Spec.Egress = []networkingv1.NetworkPolicyEgressRule{{}} // everything
		} else {
			var peers []networkingv1.NetworkPolicyPeer
			for _, a := range spec.Template.Network.Allow {
				if _, n, err := net.ParseCIDR(a); err == nil {
					peers = append(peers, networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: n.String()}})
				} else if ip := net.ParseIP(a); ip != nil {
					bits := "/32"
					if ip.To4() == nil {
						bits = "/128"
					}
					peers = append(peers, networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: ip.String() + bits}})
				} else {
					return nil, fmt.Errorf("template %s: network.allow entry %q: a NetworkPolicy admits addresses only (CIDRs or IPs), not names", spec.Template.Name, a)
				}
			}
			np.Spec.Egress = []networkingv1.NetworkPolicyEgressRule{{To: peers}}
		}
	}
	return np, nil
}

// Start starts (or reuses) the sandbox's pod and returns once its agent answers.
func (p *Provider) Start(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.StartTimeout)
	defer cancel()
	c := p.cfg.Client
	ns := p.cfg.Namespace
	name := PodName(spec.ID)
	sec, secret, pin, upgraded, err := p.agentSecret(ctx, name)
	if err != nil {
		return nil, err
	}
	if spec.Org != "" && sec.Annotations[annotationOrg] != spec.Org {
		// A pooled sandbox whose claim could not name its owner (or a broker that crashed before
		// it did): name it now, pod (when reused) included.
		if err := p.Claimed(ctx, spec); err != nil {
			return nil, err
		}
	}
	pod, err := p.podSpec(spec)
	if err != nil {
		return nil, err
	}
	if err := p.waitClaimBound(ctx, name); err != nil {
		return nil, err
	}
	if upgraded { // a pod made before its Secret had a TLS key serves without it
		if err := p.deletePod(ctx, name, 0); err != nil {
			return nil, err
		}
	}
	got, err := c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		// Reuse the pod a previous start (or another broker, or this one before a restart) made,
		// unless it is on its way out.
		got, err = c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err == nil && (got.DeletionTimestamp != nil || podEnded(got)) {
			if err = p.deletePod(ctx, name, 0); err == nil {
				got, err = c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("creating pod %s/%s: %w", ns, name, err)
	}
	running, err := p.waitRunning(ctx, got)
	if err != nil {
		// Leave nothing behind that would hold a node's resources: a resume creates it again.
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		derr := p.deletePod(cctx, name, 0)
		ccancel()
		if derr != nil {
			p.cfg.Log.Warn("deleting a pod that failed to start", "pod", name, "err", derr)
		}
		return nil, err
	}
	in := newInstance(p, spec, running, secret, pin)
	if err := in.connect(ctx); err != nil {
		in.Stop(context.WithoutCancel(ctx))
		return nil, err
	}
	return in, nil
}

// podEnded says the pod will not run again (phase Failed or Succeeded).
func podEnded(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded
}

// unschedulableGrace is how long a pod may stay unschedulable before its start fails: a claim
// being bound or a node coming up makes a pod unschedulable for a moment.
const unschedulableGrace = 15 * time.Second

// waitRunning watches the pod until its container runs and it has an address, or it cannot start.
func (p *Provider) waitRunning(ctx context.Context, pod *corev1.Pod) (*corev1.Pod, error) {
	var unschedulable time.Time // since when the pod has been unschedulable
	for {
		ok, err := podStartState(pod)
		var ue *unschedulableError
		switch {
		case errors.As(err, &ue):
			if unschedulable.IsZero() || strings.Contains(ue.msg, "unbound immediate PersistentVolumeClaims") || !p.claimBound(ctx, pod.Name) {
				// A claim still being provisioned (or bound since the scheduler's last try, which
				// it retries with a backoff) is worth the whole start timeout.
				unschedulable = time.Now()
			}
			if time.Since(unschedulable) >= unschedulableGrace {
				return nil, err
			}
		case err != nil:
			return nil, err
		case ok:
			return pod, nil
		default:
			unschedulable = time.Time{}
		}
		if !unschedulable.IsZero() {
			// Look again when the grace is over, even if nothing changes meanwhile.
			wctx, cancel := context.WithTimeout(ctx, time.Until(unschedulable.Add(unschedulableGrace)))
			fresh, err := p.watchOnce(wctx, pod)
			cancel()
			if err != nil && ctx.Err() == nil && wctx.Err() != nil {
				continue
			}
			if err != nil {
				return nil, err
			}
			pod = fresh
			continue
		}
		if pod, err = p.watchOnce(ctx, pod); err != nil {
			return nil, err
		}
	}
}

// watchOnce watches the pod from its version until its start state may have changed.
func (p *Provider) watchOnce(ctx context.Context, pod *corev1.Pod) (*corev1.Pod, error) {
	name := pod.Name
	{
		w, err := p.cfg.Client.CoreV1().Pods(p.cfg.Namespace).Watch(ctx, metav1.ListOptions{
			FieldSelector:   fields.OneTermEqualSelector("metadata.name", name).String(),
			ResourceVersion: pod.ResourceVersion,
		})
		if err != nil {
			return nil, p.startErr(ctx, name, err)
		}
		pod, err = p.nextPodState(ctx, w, pod)
		w.Stop()
		return pod, err
	}
}

// nextPodState reads the watch until the pod's start state is settled or the watch ends (then the
// caller watches again from the last version seen).
func (p *Provider) nextPodState(ctx context.Context, w watch.Interface, last *corev1.Pod) (*corev1.Pod, error) {
	for {
		select {
		case <-ctx.Done():
			return nil, p.startErr(ctx, last.Name, ctx.Err())
		case ev, ok := <-w.ResultChan():
			if !ok {
				return last, nil
			}
			switch ev.Type {
			case watch.Deleted:
				return nil, fmt.Errorf("pod %s was deleted while it started", last.Name)
			case watch.Error:
				// Expired version: read the pod afresh and watch from it.
				fresh, err := p.cfg.Client.CoreV1().Pods(p.cfg.Namespace).Get(ctx, last.Name, metav1.GetOptions{})
				if err != nil {
					return nil, p.startErr(ctx, last.Name, err)
				}
				return fresh, nil
			}
			pod, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			last = pod
			if done, err := podStartState(pod); err != nil || done {
				return pod, nil
			}
		}
	}
}

// startErr says why a start ran out of time, with the pod's last word.
func (p *Provider) startErr(ctx context.Context, name string, err error) error {
	if ctx.Err() == nil {
		return err
	}
	// The pod's last word is worth a moment, not a wait on a throttling API server.
	gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	pod, gerr := p.cfg.Client.CoreV1().Pods(p.cfg.Namespace).Get(gctx, name, metav1.GetOptions{})
	why := "no word from the cluster"
	if gerr == nil {
		why = podWhy(pod)
	}
	return fmt.Errorf("pod %s did not start within %s: %s", name, p.cfg.StartTimeout, why)
}

// podWhy is a pod's state in one line.
func podWhy(pod *corev1.Pod) string {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status != corev1.ConditionTrue && c.Message != "" {
			return "not scheduled: " + c.Message
		}
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil {
			return fmt.Sprintf("container %s waiting: %s %s", cs.Name, w.Reason, w.Message)
		}
	}
	return "phase " + string(pod.Status.Phase)
}

// podStartState: true once the sandbox container runs and the pod has an IP; an error when it
// cannot get there (the cluster's reason).
func podStartState(pod *corev1.Pod) (bool, error) {
	if podEnded(pod) {
		return false, fmt.Errorf("pod %s ended before it was ready: %s %s", pod.Name, pod.Status.Reason, pod.Status.Message)
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return false, &unschedulableError{fmt.Sprintf("pod %s cannot be scheduled: %s", pod.Name, c.Message)}
		}
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil {
			switch w.Reason {
			case "ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError", "RunContainerError":
				return false, fmt.Errorf("pod %s cannot start its container: %s: %s", pod.Name, w.Reason, w.Message)
			}
		}
		if t := cs.State.Terminated; t != nil {
			return false, fmt.Errorf("pod %s: its container exited (%s, code %d): %s", pod.Name, t.Reason, t.ExitCode, t.Message)
		}
		if cs.Name == containerName && cs.State.Running != nil && pod.Status.PodIP != "" {
			return true, nil
		}
	}
	return false, nil
}

// waitClaimBound waits (a watch) until the workspace's claim is bound when its storage class binds
// at once: a pod created on a claim still being provisioned is unschedulable, and the scheduler may
// only try it again minutes later. A class that binds on first use (WaitForFirstConsumer), or one
// the broker may not read, is not waited for.
func (p *Provider) waitClaimBound(ctx context.Context, name string) error {
	claims := p.cfg.Client.CoreV1().PersistentVolumeClaims(p.cfg.Namespace)
	pvc, err := claims.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("the workspace's claim %s/%s: %w", p.cfg.Namespace, name, err)
	}
	if pvc.Status.Phase == corev1.ClaimBound {
		return nil
	}
	if cls := pvc.Spec.StorageClassName; cls != nil && *cls != "" {
		sc, err := p.cfg.Client.StorageV1().StorageClasses().Get(ctx, *cls, metav1.GetOptions{})
		if err != nil || sc.VolumeBindingMode != nil && *sc.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer {
			return nil
		}
	}
	for {
		w, err := claims.Watch(ctx, metav1.ListOptions{
			FieldSelector:   fields.OneTermEqualSelector("metadata.name", name).String(),
			ResourceVersion: pvc.ResourceVersion,
		})
		if err != nil {
			return fmt.Errorf("watching the workspace's claim %s: %w", name, err)
		}
		for ev := range w.ResultChan() {
			if c, ok := ev.Object.(*corev1.PersistentVolumeClaim); ok {
				pvc = c
				if c.Status.Phase == corev1.ClaimBound {
					w.Stop()
					return nil
				}
			}
			if ev.Type == watch.Deleted {
				w.Stop()
				return fmt.Errorf("the workspace's claim %s was deleted", name)
			}
		}
		w.Stop()
		if ctx.Err() != nil {
			return fmt.Errorf("the workspace's claim %s/%s is not bound after %s (phase %s): does storage class %q have a provisioner?",
				p.cfg.Namespace, name, p.cfg.StartTimeout, pvc.Status.Phase, ptrStr(pvc.Spec.StorageClassName))
		}
		if fresh, err := claims.Get(ctx, name, metav1.GetOptions{}); err == nil {
			pvc = fresh
			if pvc.Status.Phase == corev1.ClaimBound {
				return nil
			}
		}
	}
}

func ptrStr(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// claimBound says whether the sandbox's claim is bound to a volume (an error counts as bound:
// the scheduler's reason then stands).
func (p *Provider) claimBound(ctx context.Context, name string) bool {
	pvc, err := p.cfg.Client.CoreV1().PersistentVolumeClaims(p.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
	return err != nil || pvc.Status.Phase == corev1.ClaimBound
}

// unschedulableError is a pod the scheduler found no node for (yet).
type unschedulableError struct{ msg string }

func (e *unschedulableError) Error() string { return e.msg }

const containerName = "sandbox"

// podSpec is the sandbox's pod.
func (p *Provider) podSpec(spec provider.Spec) (*corev1.Pod, error) {
	t := spec.Template
	image := p.cfg.Image
	pull := p.cfg.PullPolicy
	yes, no := true, false
	grace := int64(1)
	env := []corev1.EnvVar{{Name: "SBX_AGENT_SECRET_FILE", Value: "/run/sbx/" + secretKey}}
	for _, k := range sortedKeys(t.Env) {
		env = append(env, corev1.EnvVar{Name: k, Value: t.Env[k]})
	}
	mode := int32(0o400)
	res := resources(t.Limits)
	var runtimeClass *string
	var nodeSelector map[string]string
	var tolerations []corev1.Toleration
	if k := t.Kubernetes; k != nil {
		if k.Image != "" {
			image = k.Image
		}
		switch corev1.PullPolicy(k.ImagePullPolicy) {
		case "":
		case corev1.PullAlways, corev1.PullIfNotPresent, corev1.PullNever:
			pull = corev1.PullPolicy(k.ImagePullPolicy)
		default:
			return nil, fmt.Errorf("template %s: kubernetes.image_pull_policy %q is not Always, IfNotPresent or Never", t.Name, k.ImagePullPolicy)
		}
		if k.RuntimeClassName != "" {
			runtimeClass = &k.RuntimeClassName
		}
		nodeSelector = k.NodeSelector
		for _, tol := range k.Tolerations {
			tolerations = append(tolerations, corev1.Toleration{Key: tol.Key, Operator: corev1.TolerationOperator(tol.Operator),
				Value: tol.Value, Effect: corev1.TaintEffect(tol.Effect), TolerationSeconds: tol.TolerationSeconds})
		}
		for _, r := range []struct {
			field, v string
			name     corev1.ResourceName
		}{{"cpu_request", k.CPURequest, corev1.ResourceCPU}, {"memory_request", k.MemoryRequest, corev1.ResourceMemory}} {
			if r.v == "" {
				continue
			}
			q, err := resource.ParseQuantity(r.v)
			if err != nil {
				return nil, fmt.Errorf("template %s: kubernetes.%s %q: %v", t.Name, r.field, r.v, err)
			}
			res.Requests[r.name] = q
		}
	}
	pod := &corev1.Pod{
		ObjectMeta: p.meta(spec),
		Spec: corev1.PodSpec{
			// The pause container is process 1 and reaps what commands leave behind.
			ShareProcessNamespace:         &yes,
			AutomountServiceAccountToken:  &no,
			EnableServiceLinks:            &no,
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: &grace,
			RuntimeClassName:              runtimeClass,
			NodeSelector:                  nodeSelector,
			Tolerations:                   tolerations,
			Containers: []corev1.Container{{
				Name:            containerName,
				Image:           image,
				ImagePullPolicy: pull,
				Env:             env,
				WorkingDir:      provider.WorkspacePath,
				Ports:           []corev1.ContainerPort{{Name: "sbx-agent", ContainerPort: agent.Port, Protocol: corev1.ProtocolTCP}},
				VolumeMounts: []corev1.VolumeMount{
					{Name: "workspace", MountPath: provider.WorkspacePath},
					{Name: "agent", MountPath: "/run/sbx", ReadOnly: true},
				},
				SecurityContext: &corev1.SecurityContext{
					AllowPrivilegeEscalation: &no,
					Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
					SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
				},
				Resources: res,
			}},
			Volumes: []corev1.Volume{
				{Name: "workspace", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: PodName(spec.ID)}}},
				{Name: "agent", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: PodName(spec.ID), DefaultMode: &mode}}},
			},
		},
	}
	return pod, nil
}

// resources turns the template's limits into the container's: memory and CPU as limits, with
// requests at the same values so the pod is Guaranteed when both are set.
func resources(l provider.Limits) corev1.ResourceRequirements {
	r := corev1.ResourceRequirements{Limits: corev1.ResourceList{}, Requests: corev1.ResourceList{}}
	if l.MemoryBytes > 0 {
		q := *resource.NewQuantity(l.MemoryBytes, resource.BinarySI)
		r.Limits[corev1.ResourceMemory], r.Requests[corev1.ResourceMemory] = q, q
	}
	if l.CPUs > 0 {
		q := *resource.NewMilliQuantity(int64(l.CPUs*1000), resource.DecimalSI)
		r.Limits[corev1.ResourceCPU], r.Requests[corev1.ResourceCPU] = q, q
	}
	return r
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	for i := 1; i < len(keys); i++ {
		for j := i; j > 0 && keys[j] < keys[j-1]; j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
	return keys
}
