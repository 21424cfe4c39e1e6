package kube

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/tests/wait"
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

// TestClusterServices: kube-proxy makes a Service's cluster IP answer from the host and from a pod,
// and the API server answers a pod on the `kubernetes` Service (what in-cluster config dials).
func TestClusterServices(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pods := c.Client.CoreV1().Pods("default")
	svcs := c.Client.CoreV1().Services("default")
	web := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "svc-web", Labels: map[string]string{"app": "svc-web"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "c", Image: kubetest.SandboxImage, ImagePullPolicy: corev1.PullNever,
			Command: []string{"/bin/sh", "-c", "exec nc -ll -p 8080 -e /bin/echo served-by-the-pod"},
		}}},
	}
	if _, err := pods.Create(ctx, web, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer pods.Delete(context.Background(), web.Name, metav1.DeleteOptions{})
	svc, err := svcs.Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "svc-web"},
		Spec:       corev1.ServiceSpec{Selector: web.Labels, Ports: []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer svcs.Delete(context.Background(), svc.Name, metav1.DeleteOptions{})
	addr := net.JoinHostPort(svc.Spec.ClusterIP, "80")
	if err := wait.For(time.Minute, func() error {
		conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			return err
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		b, _ := io.ReadAll(conn)
		if string(b) != "served-by-the-pod\n" {
			return fmt.Errorf("%s answered %q", addr, b)
		}
		return nil
	}); err != nil {
		t.Fatalf("the Service's cluster IP from the host: %v\nkube-proxy: %s", err, c.Log("kube-proxy", 3000))
	}

	// From a pod: the Service (whose one endpoint is on the same bridge) and the API server.
	client := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "svc-client"},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{
				Name: "c", Image: kubetest.SandboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", "(nc " + svc.Spec.ClusterIP + " 80 </dev/null && wget --no-check-certificate -qO- https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/readyz && echo ' at' $KUBERNETES_SERVICE_HOST) >/dev/termination-log"},
			}},
		},
	}
	if _, err := pods.Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer pods.Delete(context.Background(), client.Name, metav1.DeleteOptions{})
	var pod *corev1.Pod
	if err := wait.For(time.Minute, func() error {
		if pod, err = pods.Get(ctx, client.Name, metav1.GetOptions{}); err != nil {
			return err
		}
		if pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed {
			return fmt.Errorf("phase %s", pod.Status.Phase)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// The output is the termination message: the API server has no credentials for kubelet's logs.
	var logs string
	if st := pod.Status.ContainerStatuses; len(st) == 1 && st[0].State.Terminated != nil {
		logs = st[0].State.Terminated.Message
	}
	if pod.Status.Phase != corev1.PodSucceeded || logs != "served-by-the-pod\nok at "+kubetest.APIServiceIP+"\n" {
		t.Fatalf("from a pod: phase %s, output %q\nkube-proxy: %s", pod.Status.Phase, logs, c.Log("kube-proxy", 3000))
	}
}
