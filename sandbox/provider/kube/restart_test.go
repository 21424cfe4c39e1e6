package kube_test

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/kube"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// TestBrokerRestartKeepsPods stops a broker gracefully and starts it again on the same data dir,
// Redis and node, as a StatefulSet's rolling update does. A pod sandbox's pod lives on without the
// broker, so the restarted broker takes it back: the same pod, its background process alive, exec
// working, and nothing on the record or in the events saying processes were lost. A pod deleted
// while the broker was down is made again (the record says its processes were lost, and a resumed
// event with broker_restart says so), and the pod of a sandbox another broker stopped meanwhile is
// deleted by the start itself.
func TestBrokerRestartKeepsPods(t *testing.T) {
	c := kube.SharedCluster(t)
	ctx := t.Context()
	const node = "node-adopt"
	// The brokers leave their pods when they stop: this test's go when it ends (registered first,
	// so it runs after every broker stopped).
	t.Cleanup(func() { deleteBrokerObjects(t, c, node) })
	newProvider := func() *kube.Provider {
		p, err := kube.New(ctx, kube.Config{
			Client: c.Client, Namespace: "default", Broker: node, Image: kubetest.SandboxImage,
			PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass, NetworkPolicies: true,
		})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	tmpl := map[string]provider.Template{"default": {Name: "default"}}
	b1 := servertest.New(t, servertest.Options{ProviderImpl: newProvider(), Node: node, Templates: tmpl})
	pods := c.Client.CoreV1().Pods("default")
	ids, uids := map[string]string{}, map[string]types.UID{}
	for _, name := range []string{"keep", "gone", "stopme"} {
		created, err := b1.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name})
		if err != nil {
			t.Fatal(err)
		}
		ids[name] = created.Sandbox.ID
		pod, err := pods.Get(ctx, kube.PodName(created.Sandbox.ID), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		uids[name] = pod.UID
	}
	pid := execIn(t, b1.Client, "keep", "sleep 1000 >/dev/null 2>&1 & echo $! > /workspace/pid; cat /workspace/pid")

	b1.Stop()
	for name, uid := range uids {
		pod, err := pods.Get(ctx, kube.PodName(ids[name]), metav1.GetOptions{})
		if err != nil || pod.UID != uid || pod.DeletionTimestamp != nil {
			t.Fatalf("sandbox %s's pod after its broker stopped: %v (want the same pod %s, left running)", name, err, uid)
		}
	}

	// While the broker is down, a pod is deleted by hand and another broker stops a sandbox.
	if err := pods.Delete(ctx, kube.PodName(ids["gone"]), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := wait.For(time.Minute, func() error {
		_, err := pods.Get(ctx, kube.PodName(ids["gone"]), metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}); err != nil {
		t.Fatalf("the pod deleted by hand is still there: %v", err)
	}
	other := servertest.New(t, servertest.Options{Node: "node-other", Redis: b1.Redis})
	if _, err := other.Client.StopSandbox(ctx, "stopme"); err != nil {
		t.Fatal(err)
	}

	b2 := servertest.New(t, servertest.Options{ProviderImpl: newProvider(), Node: node, Templates: tmpl, Redis: b1.Redis, DataDir: b1.DataDir})
	// All of it is done by the start, before the broker serves.
	if _, err := pods.Get(ctx, kube.PodName(ids["stopme"]), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the pod of a sandbox stopped while its broker was down, after the broker's start: %v (want it deleted)", err)
	}
	pod, err := pods.Get(ctx, kube.PodName(ids["keep"]), metav1.GetOptions{})
	if err != nil || pod.UID != uids["keep"] {
		t.Fatalf("the kept sandbox's pod after the restart: %v (want the same pod %s)", err, uids["keep"])
	}
	keep, err := b2.Client.GetSandbox(ctx, "keep")
	if err != nil || keep.Status != protocol.StatusRunning || keep.ProcessesLostAt != nil {
		t.Fatalf("the kept sandbox after the restart: %v %+v (want running, no processes_lost_at)", err, keep)
	}
	if out := execIn(t, b2.Client, "keep", "kill -0 $(cat /workspace/pid) && echo alive"); out != "alive" {
		t.Errorf("the background process %s after the restart: %q", pid, out)
	}
	gone, err := b2.Client.GetSandbox(ctx, "gone")
	if err != nil || gone.Status != protocol.StatusRunning || gone.ProcessesLostAt == nil {
		t.Fatalf("the sandbox whose pod was deleted, after the restart: %v %+v (want running on a new pod, processes_lost_at set)", err, gone)
	}
	if pod, err := pods.Get(ctx, kube.PodName(ids["gone"]), metav1.GetOptions{}); err != nil || pod.UID == uids["gone"] {
		t.Errorf("the pod of the sandbox whose pod was deleted: %v (want a new one)", err)
	}
	if out := execIn(t, b2.Client, "gone", "echo back"); out != "back" {
		t.Errorf("exec in the sandbox on its new pod: %q", out)
	}
	if st, err := b2.Client.GetSandbox(ctx, "stopme"); err != nil || st.Status != protocol.StatusStopped {
		t.Errorf("the sandbox stopped meanwhile: %v %+v", err, st)
	}

	// The events: a resumed one (broker_restart) for the sandbox that lost its processes, none
	// for the one that kept them.
	m, err := b2.Client.Delegate(ctx, "keep", protocol.MintRequest{Scopes: []string{protocol.ScopeExec}})
	if err != nil {
		t.Fatal(err)
	}
	resumed := map[string]int{}
	wait.Eventually(t, 10*time.Second, func() bool {
		barrier := false
		clear(resumed)
		b2.Client.Events(ctx, client.EventOptions{Backlog: 200}, func(e protocol.Event) error {
			barrier = barrier || e.Type == protocol.EventTokenMinted && e.JTI == m.JTI
			if e.Type == protocol.EventResumed && e.Reason == protocol.ReasonBrokerRestart {
				resumed[e.Name]++
			}
			return nil
		})
		return barrier
	}, "the token_minted event emitted after the start")
	if resumed["keep"] != 0 || resumed["gone"] != 1 || resumed["stopme"] != 0 {
		t.Errorf("resumed (broker_restart) events by sandbox: %v, want one for gone only", resumed)
	}
}

// execIn runs a shell command in a sandbox through the dataplane and returns its output, trimmed.
func execIn(t *testing.T, cl *client.Client, name, command string) string {
	t.Helper()
	ctx := t.Context()
	m, err := cl.Delegate(ctx, name, protocol.MintRequest{Scopes: []string{protocol.ScopeExec}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: command, Combined: true}})
	if err != nil || res.Output == nil {
		t.Fatalf("exec %q in %s: %v %+v", command, name, err, res)
	}
	return strings.TrimSpace(*res.Output)
}

// deleteBrokerObjects deletes every pod, claim, Secret and NetworkPolicy labelled with node.
func deleteBrokerObjects(t *testing.T, c *kubetest.Cluster, node string) {
	ctx := context.Background()
	sel := metav1.ListOptions{LabelSelector: kube.LabelBroker + "=" + node}
	grace := int64(0)
	del := metav1.DeleteOptions{GracePeriodSeconds: &grace}
	for _, err := range []error{
		c.Client.CoreV1().Pods("default").DeleteCollection(ctx, del, sel),
		c.Client.CoreV1().PersistentVolumeClaims("default").DeleteCollection(ctx, metav1.DeleteOptions{}, sel),
		c.Client.CoreV1().Secrets("default").DeleteCollection(ctx, metav1.DeleteOptions{}, sel),
		c.Client.NetworkingV1().NetworkPolicies("default").DeleteCollection(ctx, metav1.DeleteOptions{}, sel),
	} {
		if err != nil {
			t.Errorf("deleting what broker %s left: %v", node, err)
		}
	}
}
