package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
)

// TestSecretWithoutTLSKeyIsUpgraded: a sandbox's Secret made before the agent channel had TLS (no
// key) gets one at the sandbox's next start, and a pod made before that (whose agent started
// without it) is replaced, never talked to in clear; the secret, the key and the certificate are
// in the Secret only: not in the pod spec, the pod's events or the broker's log.
func TestSecretWithoutTLSKeyIsUpgraded(t *testing.T) {
	c := cluster(t)
	var logs bytes.Buffer
	newP := func() *Provider {
		p, err := New(context.Background(), Config{
			Client: c.Client, Namespace: "default", Broker: "tls-broker", Image: kubetest.SandboxImage,
			PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass,
			Log: slog.New(slog.NewJSONHandler(&logs, nil)),
		})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	p := newP()
	ctx := context.Background()
	spec := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: "t"}}
	if err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	defer p.Destroy(ctx, spec)
	name := PodName(spec.ID)
	secrets := c.Client.CoreV1().Secrets("default")
	strip := func() {
		t.Helper()
		sec, err := secrets.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		delete(sec.Data, agent.CertFile)
		delete(sec.Data, agent.KeyFile)
		if _, err := secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	strip()
	in, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatalf("start on a Secret without a TLS key: %v", err)
	}
	if out := sh(t, in, "echo over tls"); out != "over tls\n" {
		t.Fatalf("exec: %q", out)
	}
	sec, err := secrets.Get(ctx, name, metav1.GetOptions{})
	if err != nil || len(sec.Data[agent.CertFile]) == 0 || len(sec.Data[agent.KeyFile]) == 0 {
		t.Fatalf("the upgraded Secret: %v %v", err, sec)
	}
	pod, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	events, _ := c.Client.CoreV1().Events("default").List(ctx, metav1.ListOptions{})
	specJSON, _ := json.Marshal(pod)
	eventsJSON, _ := json.Marshal(events)
	for what, v := range map[string][]byte{"secret": sec.Data[secretKey], "key": sec.Data[agent.KeyFile], "certificate": sec.Data[agent.CertFile]} {
		for where, in := range map[string][]byte{"the pod": specJSON, "the events": eventsJSON, "the broker's log": logs.Bytes()} {
			if bytes.Contains(in, bytes.TrimSpace(v)) || bytes.Contains(in, pemBody(v)) {
				t.Errorf("the agent's %s appears in %s", what, where)
			}
		}
	}

	// A pod running when its Secret lost (never had) the key, found by a restarted broker: it is
	// replaced, not adopted.
	strip()
	in2, err := newP().Start(ctx, spec)
	if err != nil {
		t.Fatalf("start beside a pod made before the key: %v", err)
	}
	defer in2.Stop(ctx)
	pod2, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil || pod2.UID == pod.UID {
		t.Fatalf("the pod made before the key was adopted (uid %s, was %s): %v", pod2.UID, pod.UID, err)
	}
	if out := sh(t, in2, "echo replaced"); out != "replaced\n" {
		t.Fatalf("exec on the new pod: %q", out)
	}
}

// pemBody is a PEM block's base64 body's first line: what a log or a spec would hold of it.
func pemBody(v []byte) []byte {
	lines := bytes.Split(v, []byte("\n"))
	if len(lines) > 1 {
		return lines[1]
	}
	return v
}
