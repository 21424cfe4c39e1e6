package kube_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/kube"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// TestBrokerOnKubernetes runs the broker with the kubernetes provider on the real test cluster and
// drives it as a user does: create, a delegate's exec and files over the dataplane (through the
// pod's agent), stop (pod gone, files kept), resume (a new pod on the same claim), create-or-reuse
// by name, the lease (the sweeper stops an expired sandbox: its pod goes), delete (pod and claim).
func TestBrokerOnKubernetes(t *testing.T) {
	c := kube.SharedCluster(t)
	ctx := t.Context()
	p, err := kube.New(ctx, kube.Config{
		Client: c.Client, Namespace: "default", Broker: "node-k8s", Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass, NetworkPolicies: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{ProviderImpl: p, Node: "node-k8s", Now: clock.Now,
		Templates: map[string]provider.Template{"default": {Name: "default", Env: map[string]string{"GREETING": "hi"}}}})

	created, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "pod-box"})
	if err != nil {
		t.Fatal(err)
	}
	sb := created.Sandbox
	if sb.Status != protocol.StatusRunning || sb.Provider != kube.Name {
		t.Fatalf("created %+v", sb)
	}
	podName := kube.PodName(sb.ID)
	if sb.Isolation != protocol.IsolationContainer || sb.Placement == nil || sb.Placement.Pod != "default/"+podName || sb.Placement.Node != c.Node {
		t.Errorf("the view says isolation %q placement %+v, want container, default/%s on %s", sb.Isolation, sb.Placement, podName, c.Node)
	}
	pods := c.Client.CoreV1().Pods("default")
	pod, err := pods.Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the sandbox's pod: %v", err)
	}
	if pod.Labels[kube.LabelBroker] != "node-k8s" {
		t.Errorf("pod labels %v", pod.Labels)
	}

	dial := func() *backend.Remote {
		t.Helper()
		m, err := b.Client.Delegate(ctx, "pod-box", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
		if err != nil {
			t.Fatal(err)
		}
		r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		return r
	}
	r := dial()
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: `echo "$GREETING from $(hostname) in $(pwd)"`, Combined: true}})
	if err != nil || res.ExitCode != 0 || res.Output == nil || *res.Output != "hi from "+podName+" in /workspace\n" {
		t.Fatalf("exec: %v %+v", err, res)
	}
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "/workspace/keep/me.txt", Content: "survives a stop"}); err != nil {
		t.Fatal(err)
	}
	got, err := r.Read(ctx, protocol.ReadArgs{Path: "/workspace/keep/me.txt"})
	if err != nil || got.Content != "survives a stop" {
		t.Fatalf("read: %v %+v", err, got)
	}
	ls, err := r.Ls(ctx, "/workspace/keep")
	if err != nil || len(ls) != 1 || ls[0].Name != "me.txt" {
		t.Fatalf("ls: %v %+v", err, ls)
	}
	var up strings.Builder
	up.WriteString(strings.Repeat("x", 300<<10))
	if _, err := r.Upload(ctx, "/workspace/up.bin", strings.NewReader(up.String())); err != nil {
		t.Fatal(err)
	}
	var down strings.Builder
	if n, err := r.Download(ctx, "/workspace/up.bin", &down); err != nil || n != int64(up.Len()) || down.String() != up.String() {
		t.Fatalf("download: %d %v", n, err)
	}

	// The template sets no PATH, so the pod runs its image's: a bare allowlisted name with fs:write
	// is checked against the PATH the running pod reports, and refused once no pod tells it.
	bare := protocol.MintRequest{Scopes: []string{"fs:write", "exec"}, AllowCmd: []string{"sh"}}
	if _, err := b.Client.Delegate(ctx, "pod-box", bare); err != nil {
		t.Fatalf("fs:write and a bare name in a running pod whose image's PATH has no writable entry: %v", err)
	}

	// Stop: the pod goes, the claim (and the files) stay.
	if _, err := b.Client.StopSandbox(ctx, "pod-box"); err != nil {
		t.Fatal(err)
	}
	var pe *protocol.Error
	if _, err := b.Client.Delegate(ctx, "pod-box", bare); !errors.As(err, &pe) || pe.Code != protocol.CodeInvalidArgument || !strings.Contains(pe.Message, "does not know") {
		t.Errorf("fs:write and a bare name with no pod to tell its PATH: %v, want invalid_argument saying the PATH is unknown", err)
	}
	if _, err := pods.Get(ctx, podName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("the pod after stop: %v", err)
	}
	if _, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(ctx, podName, metav1.GetOptions{}); err != nil {
		t.Fatalf("the claim after stop: %v", err)
	}
	if _, err := b.Client.ResumeSandbox(ctx, "pod-box"); err != nil {
		t.Fatal(err)
	}
	r = dial()
	got, err = r.Read(ctx, protocol.ReadArgs{Path: "/workspace/keep/me.txt"})
	if err != nil || got.Content != "survives a stop" {
		t.Fatalf("read after resume: %v %+v", err, got)
	}

	// Create-or-reuse by name: the same sandbox, the same pod.
	reuse := true
	again, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "pod-box", Reuse: &reuse})
	if err != nil || again.Sandbox.ID != sb.ID || again.Outcome != protocol.OutcomeReused {
		t.Fatalf("reuse: %v %+v", err, again)
	}

	// The lease: no heartbeat past the TTL and the sweeper stops the sandbox; its pod goes.
	if _, err := b.Client.SetTTL(ctx, "pod-box", 2*time.Second); err != nil {
		t.Fatal(err)
	}
	clock.Advance(1500 * time.Millisecond)
	if _, err := b.Sweeper.SweepOnce(ctx); err != nil {
		t.Fatal(err)
	}
	clock.Advance(time.Second)
	if rep, err := b.Sweeper.SweepOnce(ctx); err != nil || rep.Stopped != 1 {
		t.Fatalf("sweep: %+v %v", rep, err)
	}
	view, err := b.Client.GetSandbox(ctx, "pod-box")
	if err != nil || view.Status != protocol.StatusStopped || view.StopReason != protocol.StopTTLExpired {
		t.Fatalf("after the lease: %v %+v", err, view)
	}
	if _, err := pods.Get(ctx, podName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("the pod after the lease ran out: %v", err)
	}

	// A pod labelled as this broker's with no record (Redis lost it, a delete crashed halfway) is
	// found by the broker's periodic reconcile (every 5 s) and deleted.
	orphanID := protocol.NewSandboxID()
	orphan, err := pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: kube.PodName(orphanID), Annotations: map[string]string{"sbx.dev/org": b.Org},
			Labels: map[string]string{kube.LabelManaged: "sbx-broker", kube.LabelBroker: "node-k8s", kube.LabelID: strings.TrimPrefix(orphanID, protocol.SandboxIDPrefix)}},
		Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever, Containers: []corev1.Container{{
			Name: "c", Image: kubetest.SandboxImage, ImagePullPolicy: corev1.PullNever, Command: []string{"/bin/sleep", "3600"}}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + orphan.Name, ResourceVersion: orphan.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.After(time.Minute)
	for gone := false; !gone; {
		select {
		case ev := <-w.ResultChan():
			gone = ev.Type == watch.Deleted
		case <-deadline:
			t.Fatal("the pod of a sandbox without a record is still there after a minute (the reconcile runs every 5 s)")
		}
	}
	w.Stop()

	// A pod deleted behind the broker's back: the sandbox says stopped, runtime_lost, and why in
	// its failure; a resume makes a new pod on the same claim and the failure goes.
	if _, err := b.Client.ResumeSandbox(ctx, "pod-box"); err != nil {
		t.Fatal(err)
	}
	if err := pods.Delete(ctx, podName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	var lost protocol.Sandbox
	wait.Eventually(t, time.Minute, func() bool {
		lost, err = b.Client.GetSandbox(ctx, "pod-box")
		return err == nil && lost.Status == protocol.StatusStopped
	}, "the sandbox whose pod was deleted is still %+v (%v)", lost, err)
	if lost.StopReason != protocol.StopRuntimeLost || !strings.Contains(lost.Failure, "pod was deleted") {
		t.Errorf("a pod deleted behind the broker's back: reason %q failure %q", lost.StopReason, lost.Failure)
	}
	back, err := b.Client.ResumeSandbox(ctx, "pod-box")
	if err != nil || back.Status != protocol.StatusRunning || back.Failure != "" || back.StopReason != "" {
		t.Fatalf("resume after the pod was lost: %v %+v", err, back)
	}
	if got, err := dial().Read(ctx, protocol.ReadArgs{Path: "/workspace/keep/me.txt"}); err != nil || got.Content != "survives a stop" {
		t.Fatalf("read after the lost pod's resume: %v %+v", err, got)
	}

	// Delete: pod and claim.
	if _, err := b.Client.DeleteSandbox(ctx, "pod-box"); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Get(ctx, podName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the pod after delete: %v", err)
	}
	if pvc, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(context.Background(), podName, metav1.GetOptions{}); !apierrors.IsNotFound(err) && (err != nil || pvc.DeletionTimestamp == nil) {
		t.Errorf("the claim after delete: %v (want it deleted or being deleted)", err)
	}
}
