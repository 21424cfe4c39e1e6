package kube_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/kube"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

// TestBrokerPoolOnKubernetes: a template with `pool: {size: 2}` keeps two pods started ahead of
// demand (labelled as the broker's, owned by no org); a create claims one (running at once, the
// pooled pod itself), and the pod, its secret, claim and NetworkPolicy then name the org and the
// sandbox, so that the reconcile matches them to the record; the pool refills; a create the org's
// quota refuses leaves the pool as it was; the reconcile ends an orphan pod but never a pooled one
// (they have no record); stop, resume and delete of the claimed sandbox behave as for any; a
// broker stop removes the pooled pods and their claims.
func TestBrokerPoolOnKubernetes(t *testing.T) {
	c := kube.SharedCluster(t)
	ctx := t.Context()
	const node = "node-kpool"
	p, err := kube.New(ctx, kube.Config{
		Client: c.Client, Namespace: "default", Broker: node, Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass, NetworkPolicies: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	b := servertest.New(t, servertest.Options{ProviderImpl: p, Node: node, Limits: store.Limits{MaxSandboxes: 1},
		Templates: map[string]provider.Template{"default": {Name: "default", Pool: provider.Pool{Size: 2}}}})
	pods := c.Client.CoreV1().Pods("default")
	mine := metav1.ListOptions{LabelSelector: kube.LabelBroker + "=" + node}
	poolStat := func() sandbox.PoolStat {
		for _, s := range b.Manager.PoolStats() {
			if s.Template == "default" {
				return s
			}
		}
		return sandbox.PoolStat{}
	}
	podNames := func() []string {
		t.Helper()
		list, err := pods.List(ctx, mine)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, pod := range list.Items {
			if pod.DeletionTimestamp == nil {
				names = append(names, pod.Name)
			}
		}
		return names
	}

	// The pool fills: two pods of this broker, owned by no org.
	wait.Eventually(t, 3*time.Minute, func() bool { return poolStat().Ready == 2 }, "the pool holds 2 pods (it has %+v)", poolStat())
	pooled := podNames()
	if len(pooled) != 2 {
		t.Fatalf("pods of a full pool of 2: %v", pooled)
	}
	for _, name := range pooled {
		pod, err := pods.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if pod.Labels[kube.LabelManaged] != "sbx-broker" || pod.Labels[kube.LabelID] == "" || pod.Labels[kube.LabelOrg] != "" || pod.Annotations["sbx.dev/org"] != "" {
			t.Errorf("pooled pod %s: labels %v annotations %v (want the broker's, no org)", name, pod.Labels, pod.Annotations)
		}
	}
	// Watch this broker's pods from here: no pooled pod may be deleted until the claimed one's delete.
	list, err := pods.List(ctx, mine)
	if err != nil {
		t.Fatal(err)
	}
	w, err := pods.Watch(ctx, metav1.ListOptions{LabelSelector: mine.LabelSelector, ResourceVersion: list.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	deleted := map[string]bool{}
	drain := func() {
		for {
			select {
			case ev := <-w.ResultChan():
				if pod, ok := ev.Object.(*corev1.Pod); ok && (ev.Type == watch.Deleted || pod.DeletionTimestamp != nil) {
					deleted[pod.Name] = true
				}
			default:
				return
			}
		}
	}

	// A create claims one: running at once, on a pooled pod, which now names the org and sandbox.
	start := time.Now()
	created, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm-box"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a create from the pool took %s", time.Since(start))
	sb := created.Sandbox
	podName := kube.PodName(sb.ID)
	if sb.Status != protocol.StatusRunning || !slices.Contains(pooled, podName) {
		t.Fatalf("created %+v, pod %s; want running on one of the pooled pods %v", sb, podName, pooled)
	}
	if sb.Placement == nil || sb.Placement.Pod != "default/"+podName {
		t.Errorf("placement %+v, want default/%s", sb.Placement, podName)
	}
	if st := poolStat(); st.Claims != 1 {
		t.Errorf("pool stats after a claim: %+v", st)
	}
	owned := func(kind string, m metav1.ObjectMeta) {
		t.Helper()
		if m.Labels[kube.LabelOrg] != b.Org || m.Labels[kube.LabelName] != "warm-box" || m.Annotations["sbx.dev/org"] != b.Org {
			t.Errorf("the claimed sandbox's %s: labels %v annotations %v, want org %s and name warm-box", kind, m.Labels, m.Annotations, b.Org)
		}
	}
	pod, err := pods.Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	owned("pod", pod.ObjectMeta)
	secret, err := c.Client.CoreV1().Secrets("default").Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	owned("secret", secret.ObjectMeta)
	pvc, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	owned("claim", pvc.ObjectMeta)
	np, err := c.Client.NetworkingV1().NetworkPolicies("default").Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	owned("network policy", np.ObjectMeta)

	m, err := b.Client.Delegate(ctx, "warm-box", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "hostname; ls -A /workspace", Combined: true}})
	if err != nil || res.ExitCode != 0 || res.Output == nil || *res.Output != podName+"\n" {
		t.Fatalf("exec in the claimed pod: %v %+v (want its hostname and an empty workspace)", err, res)
	}
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "/workspace/kept.txt", Content: "warm"}); err != nil {
		t.Fatal(err)
	}
	r.Close()

	// The pool refills; a create over the org's quota takes nothing from it.
	wait.Eventually(t, 3*time.Minute, func() bool { return poolStat().Ready == 2 }, "the pool refills to 2 (it has %+v)", poolStat())
	var pe *protocol.Error
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "over-quota"}); !errors.As(err, &pe) || pe.Code != protocol.CodeQuotaExceeded {
		t.Fatalf("a create over max_sandboxes 1: %v, want %s", err, protocol.CodeQuotaExceeded)
	}
	if st := poolStat(); st.Ready != 2 || st.Claims != 1 {
		t.Errorf("the pool after a refused create: %+v, want 2 ready and the one claim", st)
	}
	pooled = slices.DeleteFunc(podNames(), func(n string) bool { return n == podName })
	if len(pooled) != 2 {
		t.Fatalf("pooled pods after the refill: %v", pooled)
	}
	for _, name := range pooled {
		if pod, err := pods.Get(ctx, name, metav1.GetOptions{}); err != nil || pod.Labels[kube.LabelOrg] != "" {
			t.Errorf("pooled pod %s after a refused create: %v %v", name, err, pod.Labels)
		}
	}

	// The reconcile (every 5 s) ends a pod of this broker whose sandbox has no record; once it
	// has, it has seen the pooled pods, which have no record either, and left them.
	orphanID := protocol.NewSandboxID()
	orphan, err := pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: kube.PodName(orphanID), Annotations: map[string]string{"sbx.dev/org": b.Org},
			Labels: map[string]string{kube.LabelManaged: "sbx-broker", kube.LabelBroker: node, kube.LabelID: kube.PodName(orphanID)[len("sbx-"):]}},
		Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever, Containers: []corev1.Container{{
			Name: "c", Image: kubetest.SandboxImage, ImagePullPolicy: corev1.PullNever, Command: []string{"/bin/sleep", "3600"}}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	wait.Eventually(t, time.Minute, func() bool {
		_, err := pods.Get(ctx, orphan.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}, "the reconcile deletes the pod of a sandbox without a record")
	drain()
	for _, name := range append(pooled, podName) {
		if deleted[name] {
			t.Errorf("the reconcile deleted pod %s (pooled, or the claimed sandbox's)", name)
		}
	}

	// Stop, resume and delete of the claimed sandbox, as for any. Its secret is stripped of its
	// owner first, as when the claim's labelling failed or the broker crashed before it: the
	// resume names the owner again.
	strip := []byte(`{"metadata":{"labels":{"sbx.dev/org":null,"sbx.dev/name":null},"annotations":{"sbx.dev/org":null}}}`)
	if _, err := c.Client.CoreV1().Secrets("default").Patch(ctx, podName, types.MergePatchType, strip, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.StopSandbox(ctx, "warm-box"); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Get(ctx, podName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("the claimed sandbox's pod after stop: %v", err)
	}
	if _, err := b.Client.ResumeSandbox(ctx, "warm-box"); err != nil {
		t.Fatal(err)
	}
	if pod, err = pods.Get(ctx, podName, metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	owned("pod after resume", pod.ObjectMeta)
	if secret, err = c.Client.CoreV1().Secrets("default").Get(ctx, podName, metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	owned("secret after resume", secret.ObjectMeta)
	m, err = b.Client.Delegate(ctx, "warm-box", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	r, err = backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := r.Read(ctx, protocol.ReadArgs{Path: "/workspace/kept.txt"}); err != nil || got.Content != "warm" {
		t.Fatalf("read after resume: %v %+v", err, got)
	}
	r.Close()
	if _, err := b.Client.DeleteSandbox(ctx, "warm-box"); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Get(ctx, podName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the claimed sandbox's pod after delete: %v", err)
	}
	drain()
	for _, name := range pooled {
		if deleted[name] {
			t.Errorf("pooled pod %s was deleted before the broker stopped", name)
		}
	}

	// A broker stop removes the pooled pods and everything made for them.
	b.Stop()
	gone := func(kind string, list func() (int, error)) {
		t.Helper()
		n, err := list()
		if err != nil || n != 0 {
			t.Errorf("after the broker stopped, %d %s of its pool are left (%v)", n, kind, err)
		}
	}
	gone("pods", func() (int, error) { return len(podNames()), nil })
	gone("secrets", func() (int, error) {
		l, err := c.Client.CoreV1().Secrets("default").List(ctx, mine)
		return len(l.Items), err
	})
	gone("claims", func() (int, error) {
		l, err := c.Client.CoreV1().PersistentVolumeClaims("default").List(ctx, mine)
		n := 0
		for _, pvc := range l.Items {
			if pvc.DeletionTimestamp == nil {
				n++
			}
		}
		return n, err
	})
	gone("network policies", func() (int, error) {
		l, err := c.Client.NetworkingV1().NetworkPolicies("default").List(ctx, mine)
		return len(l.Items), err
	})
}

// TestBrokerStartEndsPooledPodsLeftWithoutTrace: a pooled pod (no owner) of this broker's node that
// its data dir knows nothing of (an earlier broker lost its data dir with the pool running) is
// ended by the next start, before the pool fills; its secret and claim stay (files are never
// deleted on a missing record's word).
func TestBrokerStartEndsPooledPodsLeftWithoutTrace(t *testing.T) {
	c := kube.SharedCluster(t)
	ctx := t.Context()
	const node = "node-kleft"
	p, err := kube.New(ctx, kube.Config{
		Client: c.Client, Namespace: "default", Broker: node, Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass,
	})
	if err != nil {
		t.Fatal(err)
	}
	// What a pool's fill makes: Create and Start with no org or name.
	spec := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: "default"}}
	if err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	defer p.Destroy(context.WithoutCancel(ctx), spec)
	inst, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.WithoutCancel(ctx))
	name := kube.PodName(spec.ID)

	servertest.New(t, servertest.Options{ProviderImpl: p, Node: node})
	if _, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the pooled pod left without a trace, after the broker started: %v (want it deleted)", err)
	}
	if _, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(ctx, name, metav1.GetOptions{}); err != nil {
		t.Errorf("its claim: %v (want it kept)", err)
	}
	if _, err := c.Client.CoreV1().Secrets("default").Get(ctx, name, metav1.GetOptions{}); err != nil {
		t.Errorf("its secret: %v (want it kept)", err)
	}
}
