package kube

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
)

// TestClusterRunsAPod: the test cluster schedules a pod of the locally built sandbox image, starts
// it with containerd and runc, gives it an address on the CNI bridge and runs its command.
func TestClusterRunsAPod(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pods := c.Client.CoreV1().Pods("default")
	pod, err := pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "smoke"},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{
				Name: "c", Image: kubetest.SandboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", "echo hello from the pod; sleep 3600"},
			}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer pods.Delete(context.Background(), pod.Name, metav1.DeleteOptions{})
	for {
		pod, err = pods.Get(ctx, "smoke", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if pod.Status.Phase == corev1.PodRunning && pod.Status.PodIP != "" {
			break
		}
		if pod.Status.Phase == corev1.PodFailed {
			t.Fatalf("pod failed: %+v", pod.Status)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("pod not running: %s\nkubelet: %s\ncontainerd: %s", podWhy(pod), c.Log("kubelet", 3000), c.Log("containerd", 3000))
		case <-time.After(100 * time.Millisecond):
		}
	}
	if pod.Spec.NodeName != c.Node {
		t.Errorf("pod on node %q, want %q", pod.Spec.NodeName, c.Node)
	}
}
