package kube

import (
	"context"
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
)

// TestAdoptTakesBackOnlyAPodThatProvesItself: a pod let go of (Detach) runs on and is taken back
// (Adopt) with its processes; one whose agent no longer passes the pin of the sandbox's Secret (an
// impostor, or a Secret changed behind the broker) is refused and deleted, so that Start makes a
// new one; a pod that is gone is refused without a delete.
func TestAdoptTakesBackOnlyAPodThatProvesItself(t *testing.T) {
	c := cluster(t)
	ctx := context.Background()
	p, err := New(ctx, Config{
		Client: c.Client, Namespace: "default", Broker: "adopt-broker", Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass,
	})
	if err != nil {
		t.Fatal(err)
	}
	spec := provider.Spec{ID: protocol.NewSandboxID(), Org: "o", Name: "n", Template: provider.Template{Name: "t"}}
	if err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	defer p.Destroy(ctx, spec)
	name := PodName(spec.ID)
	pods := c.Client.CoreV1().Pods("default")
	in, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	first, err := pods.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pid := strings.TrimSpace(sh(t, in, "sleep 1000 >/dev/null 2>&1 & echo $!"))

	p.Detach(in)
	<-in.Done()
	back, err := p.Adopt(ctx, spec)
	if err != nil {
		t.Fatalf("taking back a pod let go of: %v", err)
	}
	if pod, err := pods.Get(ctx, name, metav1.GetOptions{}); err != nil || pod.UID != first.UID {
		t.Fatalf("the pod taken back: %v (want the same pod)", err)
	}
	if out := sh(t, back, "kill -0 "+pid+" && echo alive"); out != "alive\n" {
		t.Errorf("the background process in the pod taken back: %q", out)
	}

	// The Secret now holds another certificate: the agent running in the pod cannot present it.
	p.Detach(back)
	secrets := c.Client.CoreV1().Secrets("default")
	sec, err := secrets.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if sec.Data[agent.CertFile], sec.Data[agent.KeyFile], err = agent.NewCredentials(); err != nil {
		t.Fatal(err)
	}
	if _, err := secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = p.Adopt(ctx, spec)
	var na *provider.NotAdoptedError
	if !errors.As(err, &na) {
		t.Fatalf("taking back a pod whose agent fails the pin: %v (want a NotAdoptedError)", err)
	}
	if _, err := pods.Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the pod that failed the pin, after Adopt: %v (want it deleted)", err)
	}
	if _, err = p.Adopt(ctx, spec); !errors.As(err, &na) || na.Reason != notThere {
		t.Errorf("taking back a pod that is gone: %v", err)
	}
	fresh, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatalf("a start after the refusal: %v", err)
	}
	defer fresh.Stop(ctx)
	if out := sh(t, fresh, "echo fresh"); out != "fresh\n" {
		t.Errorf("exec in the new pod: %q", out)
	}
}
