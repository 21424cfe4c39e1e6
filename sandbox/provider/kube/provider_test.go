package kube

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
)

func newProvider(t *testing.T) (*Provider, *kubetest.Cluster) {
	t.Helper()
	c := cluster(t)
	// The test broker reaches pods from the node through the CNI bridge (whose CNI does not
	// enforce policies: only the policy's shape is checked here).
	from, err := ParseAgentFrom([]string{"10.244.0.1", BrokerPodLabel})
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(context.Background(), Config{
		Client: c.Client, Namespace: "default", Broker: "test-broker", Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass, NetworkPolicies: true, AgentFrom: from,
	})
	if err != nil {
		t.Fatal(err)
	}
	return p, c
}

func sh(t *testing.T, in provider.Instance, cmd string) string {
	t.Helper()
	var out bytes.Buffer
	res, err := in.Exec(context.Background(), provider.ExecRequest{Command: cmd, Stdout: &out})
	if err != nil {
		t.Fatalf("exec %q: %v", cmd, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exec %q: exit %d: %s", cmd, res.ExitCode, out.String())
	}
	return out.String()
}

func files(t *testing.T, in provider.Instance) sandbox.Files {
	t.Helper()
	fi, ok := in.(interface{ Files() sandbox.Files })
	if !ok {
		t.Fatal("a kubernetes instance serves no files")
	}
	return fi.Files()
}

// TestProviderLifecycle: create (idempotent), start a pod, exec and files through its agent over
// the pod network, stop (pod gone, claim kept), resume on the same claim (files survive), a pod
// deleted behind the broker's back ends the instance, destroy removes everything.
func TestProviderLifecycle(t *testing.T) {
	p, c := newProvider(t)
	ctx := context.Background()
	spec := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{
		Name: "t", Env: map[string]string{"FROM": "tmpl"}, Limits: provider.Limits{MemoryBytes: 128 << 20, CPUs: 0.5}}}
	for range 2 {
		if err := p.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	in, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatalf("start: %v\nkubelet: %s", err, c.Log("kubelet", 2000))
	}
	t.Logf("cold pod to ready: %s", time.Since(start).Round(time.Millisecond))
	name := PodName(spec.ID)
	pod, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Labels[LabelManaged] != managedBy || pod.Labels[LabelBroker] != "test-broker" {
		t.Errorf("pod labels %v", pod.Labels)
	}
	if got := pod.Spec.Containers[0].Resources.Limits.Memory().Value(); got != 128<<20 {
		t.Errorf("memory limit %d", got)
	}
	for _, e := range pod.Spec.Containers[0].Env {
		if strings.Contains(e.Value, "secret") && e.Name != "SBX_AGENT_SECRET_FILE" {
			t.Errorf("the pod spec carries %s=%s", e.Name, e.Value)
		}
	}
	if out := sh(t, in, `echo "$FROM $(pwd)"`); out != "tmpl /workspace\n" {
		t.Errorf("exec: %q", out)
	}
	if in.Environment()["FROM"] != "tmpl" {
		t.Errorf("environment %v", in.Environment())
	}
	if _, err := files(t, in).Write(protocol.WriteArgs{Path: "/workspace/notes.txt", Content: "kept"}); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, in, "cat /workspace/notes.txt"); out != "kept" {
		t.Errorf("written through the agent, read by cat: %q", out)
	}
	// Figures for the record (not asserted): exec true and a 4 KiB write+read through the pod
	// network, medians of 30.
	p50 := func(fn func()) time.Duration {
		var d []time.Duration
		for range 30 {
			t0 := time.Now()
			fn()
			d = append(d, time.Since(t0))
		}
		slices.Sort(d)
		return d[len(d)/2]
	}
	f := files(t, in)
	four := strings.Repeat("x", 4096)
	t.Logf("through the pod network: exec true p50 %s, 4 KiB write+read p50 %s",
		p50(func() { in.Exec(ctx, provider.ExecRequest{Argv: []string{"true"}}) }),
		p50(func() {
			f.Write(protocol.WriteArgs{Path: "/workspace/4k", Content: four})
			f.ReadContext(ctx, protocol.ReadArgs{Path: "/workspace/4k"})
		}))

	// Start again while it runs: the pod is reused, not replaced.
	again, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if again.(*instance).uid != in.(*instance).uid {
		t.Error("a second start replaced the running pod")
	}
	again.(*instance).cancel()

	if err := in.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-in.Done():
	default:
		t.Error("Done not closed by Stop")
	}
	if _, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("pod after stop: %v", err)
	}
	if _, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(ctx, name, metav1.GetOptions{}); err != nil {
		t.Errorf("claim after stop: %v", err)
	}

	in, err = p.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	got, err := files(t, in).ReadContext(ctx, protocol.ReadArgs{Path: "/workspace/notes.txt"})
	if err != nil || got.Content != "kept" {
		t.Errorf("after resume: %+v %v", got, err)
	}

	// Deleted behind the broker's back: the instance ends, exec says the sandbox stopped.
	zero := int64(0)
	if err := c.Client.CoreV1().Pods("default").Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-in.Done():
	case <-time.After(time.Minute):
		t.Fatal("Done not closed after the pod was deleted")
	}
	if _, err := in.Exec(ctx, provider.ExecRequest{Command: "true"}); !errors.Is(err, provider.ErrStopped) {
		t.Errorf("exec on a deleted pod: %v, want ErrStopped", err)
	}

	if err := p.Destroy(ctx, spec); err != nil {
		t.Fatal(err)
	}
	// The claim goes once the protection controller sees no pod using it: deleted or on its way.
	if pvc, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) && (err != nil || pvc.DeletionTimestamp == nil) {
		t.Errorf("claim after destroy: %v", err)
	}
	if _, err := c.Client.CoreV1().Secrets("default").Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("secret after destroy: %v", err)
	}
}

// TestTemplateToPod: the template's kubernetes section, limits and network become the pod's image,
// requests and limits, node selector, tolerations and runtime class, and its NetworkPolicy; a
// template the cluster cannot run fails the start with the cluster's reason and leaves no pod.
func TestTemplateToPod(t *testing.T) {
	p, c := newProvider(t)
	ctx := context.Background()
	secs := int64(30)
	spec := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{
		Name: "mapped", Limits: provider.Limits{MemoryBytes: 64 << 20, CPUs: 0.25},
		Network: provider.Network{Enabled: true, Allow: []string{"10.1.2.0/24", "192.0.2.7"}},
		Kubernetes: &provider.KubernetesTemplate{
			NodeSelector:  map[string]string{"kubernetes.io/hostname": c.Node},
			Tolerations:   []provider.KubernetesToleration{{Key: "sbx/dedicated", Operator: "Exists", Effect: "NoSchedule", TolerationSeconds: nil}, {Key: "x", Value: "y", Effect: "NoExecute", TolerationSeconds: &secs}},
			MemoryRequest: "32Mi",
		}}}
	if err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	defer p.Destroy(ctx, spec)
	in, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Stop(ctx)
	pod, err := c.Client.CoreV1().Pods("default").Get(ctx, PodName(spec.ID), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctr := pod.Spec.Containers[0]
	if ctr.Resources.Requests.Memory().Value() != 32<<20 || ctr.Resources.Limits.Memory().Value() != 64<<20 || ctr.Resources.Limits.Cpu().MilliValue() != 250 {
		t.Errorf("resources %+v", ctr.Resources)
	}
	if pod.Spec.NodeSelector["kubernetes.io/hostname"] != c.Node || len(pod.Spec.Tolerations) < 2 {
		t.Errorf("placement: selector %v tolerations %v", pod.Spec.NodeSelector, pod.Spec.Tolerations)
	}
	np, err := c.Client.NetworkingV1().NetworkPolicies("default").Get(ctx, PodName(spec.ID), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(np.Spec.Egress) != 1 || len(np.Spec.Egress[0].To) != 2 || np.Spec.Egress[0].To[1].IPBlock.CIDR != "192.0.2.7/32" {
		t.Errorf("egress of an allowlist: %+v", np.Spec.Egress)
	}
	if in := np.Spec.Ingress; len(in) != 1 || len(in[0].Ports) != 1 || in[0].Ports[0].Port.IntValue() != agent.Port ||
		len(in[0].From) != 2 || in[0].From[0].IPBlock.CIDR != "10.244.0.1/32" || in[0].From[1].PodSelector == nil {
		t.Errorf("ingress: %+v, want the agent's port from the brokers only", in)
	}

	closed := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: "closed"}}
	if err := p.Create(ctx, closed); err != nil {
		t.Fatal(err)
	}
	defer p.Destroy(ctx, closed)
	np, err = c.Client.NetworkingV1().NetworkPolicies("default").Get(ctx, PodName(closed.ID), metav1.GetOptions{})
	if err != nil || len(np.Spec.Egress) != 0 || len(np.Spec.PolicyTypes) != 2 {
		t.Errorf("a template without network: egress %+v types %v (%v), want all egress denied", np.Spec.Egress, np.Spec.PolicyTypes, err)
	}

	named := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: "named", Network: provider.Network{Enabled: true, Allow: []string{"example.com"}}}}
	if err := p.Create(ctx, named); err == nil || !strings.Contains(err.Error(), "not names") {
		t.Errorf("an allowlist of names: %v", err)
	}
	p.Destroy(ctx, named)

	for _, bad := range []struct {
		name, want string
		k          provider.KubernetesTemplate
	}{
		{"no-image", "ErrImageNeverPull", provider.KubernetesTemplate{Image: "sbx.local/missing:1"}},
		{"no-node", "cannot be scheduled", provider.KubernetesTemplate{NodeSelector: map[string]string{"sbx/none": "x"}}},
		{"no-class", "RuntimeClass", provider.KubernetesTemplate{RuntimeClassName: "no-such-class"}},
		{"bad-request", "cpu_request", provider.KubernetesTemplate{CPURequest: "lots"}},
	} {
		spec := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: bad.name, Kubernetes: &bad.k}}
		if err := p.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		_, err := p.Start(ctx, spec)
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%s: start: %v, want the cluster's reason (%s)", bad.name, err, bad.want)
		}
		if _, gerr := c.Client.CoreV1().Pods("default").Get(ctx, PodName(spec.ID), metav1.GetOptions{}); !apierrors.IsNotFound(gerr) {
			t.Errorf("%s: a pod is left after a failed start: %v", bad.name, gerr)
		}
		if err := p.Destroy(ctx, spec); err != nil {
			t.Error(err)
		}
	}
}
