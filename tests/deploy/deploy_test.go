// Package deploy tests the broker's deploy manifests (deploy/kubernetes) on a real single-node
// cluster (sandbox/provider/kube/kubetest): it applies them with `kubectl apply -k` through the
// overlay in this directory, with a broker image built here, and drives the deployed brokers with
// the real sbctl through their Service's cluster IP.
package deploy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider/kube"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/store/redistest"
	"github.com/sbxbroker/broker/tests/wait"
)

// ns is the overlay's namespace (kustomization.yaml); dataClass its brokers' data claims' class.
const (
	ns        = "sbx-deploy-test"
	dataClass = "sbx-deploy-test-data"
	brokerUID = 65532 // the StatefulSet's runAsUser
)

// TestDeployManifests: the manifests, applied as docs/operations.md says (the operator's Secrets
// first, then `kubectl apply -k`), give two Ready brokers running under the Role and nothing more,
// both answering through the Service; the first API key is made with `kubectl exec ... broker keys
// create`; through the Service's cluster IP, sbctl creates a sandbox (a pod placed by the broker
// from its in-cluster config), runs a command in it and deletes it; a sandbox created through the
// Service is deleted through the other replica (its hosting broker removes the pod); a replica
// deleted by hand comes back under its name and brings its running sandbox back, files and all.
// Everything applied is deleted at the end.
func TestDeployManifests(t *testing.T) {
	// kubectl v1.32.4 (with its kustomize) is built and cached with the cluster's binaries by
	// scripts/kube.sh, so the test does not depend on whichever kubectl a machine has on PATH.
	bin, err := kubetest.Binaries()
	if err != nil {
		t.Fatal(err)
	}
	kubectlBin := filepath.Join(bin, "kubectl")
	ctx, cancel := context.WithTimeout(t.Context(), 8*time.Minute)
	defer cancel()
	start := time.Now()
	c, err := kubetest.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stopping the cluster: %v", err)
		}
		if left := kubetest.Leftovers(); len(left) > 0 {
			t.Errorf("the stopped cluster left %v", left)
		}
	}()
	kubectl := func(args ...string) (string, error) {
		// Only stdout is the answer: kubectl's and the exec'd command's warnings on stderr
		// once ended up inside the API key read from `broker keys create -o key`.
		cmd := exec.CommandContext(ctx, kubectlBin, append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			return stdout.String() + stderr.String(), fmt.Errorf("kubectl %s: %v: %s%s", strings.Join(args, " "), err, stdout.Bytes(), stderr.Bytes())
		}
		return stdout.String(), nil
	}
	// diagnose is what a failure shows of the brokers.
	diagnose := func() string {
		var b strings.Builder
		for _, args := range [][]string{
			{"-n", ns, "get", "pods,pvc,events", "-o", "wide"},
			{"-n", ns, "logs", "sbx-broker-0", "--all-containers", "--tail", "40"},
			{"-n", ns, "logs", "sbx-broker-1", "--all-containers", "--tail", "40"},
		} {
			out, _ := kubectl(args...)
			b.WriteString(out)
		}
		return b.String()
	}

	// The broker image and the host's binaries.
	broker, err := c.BuildStatic(ctx, "./cmd/broker")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Import(ctx, kubetest.BrokerImageSpec(broker)); err != nil {
		t.Fatal(err)
	}
	sbctl, err := c.BuildStatic(ctx, "./cmd/sbctl")
	if err != nil {
		t.Fatal(err)
	}
	redis := redistest.StartOn(t, c.NodeIP) // pods reach it on the node's address
	tmp := t.TempDir()

	// What the operator makes first: the namespace, the Redis Secret, the shared signing keys.
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	keys := filepath.Join(tmp, "sbx-signing")
	if out, err := exec.CommandContext(ctx, broker, "keys", "rotate-signing", "--signing-keys", keys, "--token-max-ttl", "24h").CombinedOutput(); err != nil {
		t.Fatalf("broker keys rotate-signing: %v: %s", err, out)
	}
	for _, args := range [][]string{
		{"-n", ns, "create", "secret", "generic", "sbx-broker-redis", "--from-literal=url=" + redis.URL},
		{"-n", ns, "create", "secret", "generic", "sbx-broker-signing", "--from-file=" + keys},
	} {
		if _, err := kubectl(args...); err != nil {
			t.Fatal(err)
		}
	}
	// The brokers' data claims bind to volumes made here: the test cluster's hostpath provisioner
	// makes root-owned 0750 directories, which fsGroup does not reach, and the brokers are not root.
	pvs := c.Client.CoreV1().PersistentVolumes()
	for i := range 2 {
		dir := filepath.Join(tmp, fmt.Sprintf("data-%d", i))
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(dir, brokerUID, brokerUID); err != nil {
			t.Fatal(err)
		}
		_, err := pvs.Create(ctx, &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", dataClass, i)},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
				StorageClassName:              dataClass,
				ClaimRef:                      &corev1.ObjectReference{Namespace: ns, Name: fmt.Sprintf("data-sbx-broker-%d", i)},
				PersistentVolumeSource:        corev1.PersistentVolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: dir}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}

	if _, err := kubectl("apply", "-k", "."); err != nil {
		t.Fatal(err)
	}
	defer func() {
		// Everything applied (the namespace holds the rest, sandboxes' objects included), then the
		// volumes made above; the namespace is gone when kubectl returns.
		if _, err := kubectl("delete", "-k", ".", "--wait", "--timeout=3m"); err != nil {
			t.Errorf("deleting what was applied: %v", err)
		}
		for i := range 2 {
			if err := pvs.Delete(context.Background(), fmt.Sprintf("%s-%d", dataClass, i), metav1.DeleteOptions{}); err != nil {
				t.Errorf("deleting the data volume: %v", err)
			}
		}
		if _, err := c.Client.CoreV1().Namespaces().Get(context.Background(), ns, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("namespace %s after kubectl delete -k: %v", ns, err)
		}
	}()
	applied := time.Now()
	if _, err := kubectl("-n", ns, "rollout", "status", "statefulset/sbx-broker", "--timeout=3m"); err != nil {
		t.Fatalf("%v\n%s", err, diagnose())
	}
	t.Logf("cluster and images ready %s after the start; both brokers Ready %s after kubectl apply",
		applied.Sub(start).Round(time.Millisecond), time.Since(applied).Round(time.Millisecond))

	// The brokers run as the ServiceAccount bound to the Role, which grants what the provider
	// uses and no more.
	for check, want := range map[string]string{
		"create pods": "yes", "patch networkpolicies.networking.k8s.io": "yes", "watch persistentvolumeclaims": "yes",
		"update secrets": "yes", "list secrets": "no", "get nodes": "no", "create pods --subresource=exec": "no", "update pods": "no",
	} {
		out, _ := kubectl(append([]string{"-n", ns, "auth", "can-i", "--as=system:serviceaccount:" + ns + ":sbx-broker"}, strings.Fields(check)...)...)
		got := "" // the answer is the line saying yes or no; kubectl may print a warning after it
		for _, line := range strings.Split(out, "\n") {
			if line == "yes" || line == "no" {
				got = line
				break
			}
		}
		if got != want {
			t.Errorf("the brokers' ServiceAccount: can-i %s = %q, want %s", check, out, want)
		}
	}

	// The first API key, as docs/operations.md says to make it.
	out, err := kubectl("-n", ns, "exec", "sbx-broker-0", "-c", "broker", "--", "broker", "keys", "create", "--org", "smoke", "--name", "deploy-test", "-o", "key")
	if err != nil {
		t.Fatalf("%v\n%s", err, diagnose())
	}
	apiKey := strings.TrimSpace(out)
	if apiKey == "" || strings.ContainsAny(apiKey, " \t\r\n") {
		t.Fatalf("broker keys create -o key printed %d lines, want the key alone on one", strings.Count(out, "\n"))
	}

	svc, err := c.Client.CoreV1().Services(ns).Get(ctx, "sbx-broker", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	service := "http://" + net.JoinHostPort(svc.Spec.ClusterIP, "7070")
	brokerPods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=sbx-broker"})
	if err != nil || len(brokerPods.Items) != 2 {
		t.Fatalf("broker pods: %v %d", err, len(brokerPods.Items))
	}
	podByIP := map[string]string{}
	for _, p := range brokerPods.Items {
		podByIP[p.Status.PodIP] = p.Name
	}

	// Both replicas answer through the Service (kube-proxy spreads connections at random).
	seen := map[string]bool{}
	if err := wait.For(time.Minute, func() error {
		tr := &http.Transport{DisableKeepAlives: true} // a new connection, so another pick
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get(service + "/readyz")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		var r struct {
			Ready    bool   `json:"ready"`
			Node     string `json:"node"`
			Provider string `json:"provider"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || !r.Ready || r.Provider != kube.Name {
			return fmt.Errorf("/readyz through the Service: %v %+v", err, r)
		}
		seen[r.Node] = true
		if !seen["sbx-broker-0"] || !seen["sbx-broker-1"] {
			return fmt.Errorf("only %v answered", seen)
		}
		return nil
	}); err != nil {
		t.Fatalf("%v\n%s", err, diagnose())
	}

	env := append(os.Environ(), "HOME="+tmp, "XDG_CONFIG_HOME=", "SBCTL_CONFIG="+filepath.Join(tmp, "sbctl.yaml"), "SBX_API_KEY="+apiKey)
	run := func(broker string, args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, sbctl, args...)
		cmd.Env = append(env, "SBX_BROKER_URL="+broker)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return string(out), fmt.Errorf("sbctl %s (broker %s): %v: %s", strings.Join(args, " "), broker, err, out)
		}
		return string(out), nil
	}
	create := func(name string) (protocol.Sandbox, string) {
		t.Helper()
		out, err := run(service, "create", name, "-o", "json")
		if err != nil {
			t.Fatalf("%v\n%s", err, diagnose())
		}
		var res protocol.CreateSandboxResponse
		if err := json.Unmarshal([]byte(out), &res); err != nil || res.Sandbox.Status != protocol.StatusRunning {
			t.Fatalf("sbctl create %s: %v %s", name, err, out)
		}
		u, err := url.Parse(res.Sandbox.DataplaneURL)
		if err != nil || podByIP[u.Hostname()] == "" {
			t.Fatalf("sandbox %s's dataplane_url %q is no broker pod's (%v)", name, res.Sandbox.DataplaneURL, podByIP)
		}
		host := podByIP[u.Hostname()]
		pod, err := c.Client.CoreV1().Pods(ns).Get(ctx, kube.PodName(res.Sandbox.ID), metav1.GetOptions{})
		if err != nil || pod.Labels[kube.LabelBroker] != host {
			t.Fatalf("sandbox %s's pod: %v, labels %v, want it hosted by %s", name, err, pod.Labels, host)
		}
		return res.Sandbox, host
	}
	gone := func(sb protocol.Sandbox) {
		t.Helper()
		name := kube.PodName(sb.ID)
		if err := wait.For(time.Minute, func() error {
			if _, err := c.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return fmt.Errorf("pod %s: %v", name, err)
			}
			if _, err := c.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return fmt.Errorf("claim %s: %v", name, err)
			}
			// The record goes last, once the hosting broker has removed the sandbox's objects.
			if out, err := run(service, "list", "-o", "json"); err != nil || strings.Contains(out, `"`+sb.Name+`"`) {
				return fmt.Errorf("sbctl list: %v %s", err, out)
			}
			return nil
		}); err != nil {
			t.Fatalf("sandbox %s after its delete: %v\n%s", sb.Name, err, diagnose())
		}
	}

	// Create, exec, delete through the Service.
	a, _ := create("smoke-a")
	if out, err := run(service, "exec", "smoke-a", "--", "echo", "hello from", "the pod"); err != nil || out != "hello from the pod\n" {
		t.Fatalf("sbctl exec: %q %v\n%s", out, err, diagnose())
	}
	if _, err := run(service, "delete", "smoke-a"); err != nil {
		t.Fatal(err)
	}
	gone(a)

	// A sandbox created through the Service is deleted through the replica that does not host it.
	b, host := create("smoke-b")
	var other string
	for ip, name := range podByIP {
		if name != host {
			other = "http://" + net.JoinHostPort(ip, "7070")
		}
	}
	if _, err := run(other, "delete", "smoke-b"); err != nil {
		t.Fatal(err)
	}
	gone(b)
	if out, err := run(service, "list", "-o", "json"); err != nil || strings.Contains(out, "smoke-") {
		t.Errorf("sbctl list after the deletes: %v %s", err, out)
	}

	// A replica that restarts keeps its name, so its node and its data claim: a sandbox it hosted,
	// running, is taken back with its pod, which ran on meanwhile, its processes with it (why a
	// StatefulSet).
	d, host := create("smoke-d")
	if _, err := run(service, "exec", "smoke-d", "--", "sh", "-c", "echo kept > /workspace/f; sleep 1000 >/dev/null 2>&1 & echo $! > /workspace/pid"); err != nil {
		t.Fatal(err)
	}
	before, err := c.Client.CoreV1().Pods(ns).Get(ctx, kube.PodName(d.ID), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	restarted := time.Now()
	if _, err := kubectl("-n", ns, "delete", "pod", host, "--wait"); err != nil {
		t.Fatal(err)
	}
	if _, err := kubectl("-n", ns, "rollout", "status", "statefulset/sbx-broker", "--timeout=3m"); err != nil {
		t.Fatalf("%v\n%s", err, diagnose())
	}
	if err := wait.For(2*time.Minute, func() error {
		out, err := run(service, "exec", "smoke-d", "--", "sh", "-c", "cat /workspace/f; kill -0 $(cat /workspace/pid) && echo alive")
		if err != nil || out != "kept\nalive\n" {
			return fmt.Errorf("%q %v", out, err)
		}
		return nil
	}); err != nil {
		t.Fatalf("%v\n%s", err, diagnose())
	}
	if pod, err := c.Client.CoreV1().Pods(ns).Get(ctx, kube.PodName(d.ID), metav1.GetOptions{}); err != nil || pod.UID != before.UID {
		t.Errorf("the sandbox's pod after its broker's restart: %v (want the same pod, %s, taken back)", err, before.UID)
	}
	if out, err := run(service, "get", "smoke-d", "-o", "json"); err != nil || strings.Contains(out, "processes_lost_at") {
		t.Errorf("the sandbox after its broker's restart: %v %s (want no processes_lost_at: nothing was lost)", err, out)
	}
	t.Logf("broker %s deleted, back, and its sandbox running again in %s", host, time.Since(restarted).Round(time.Millisecond))
	if _, err := run(service, "delete", "smoke-d"); err != nil {
		t.Fatal(err)
	}
	gone(d)

	// Nothing the brokers asked of the API server was refused: the Role is enough.
	for _, p := range []string{"sbx-broker-0", "sbx-broker-1"} {
		out, err := kubectl("-n", ns, "logs", p, "-c", "broker")
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(strings.ToLower(out), "forbidden") {
			t.Errorf("broker %s was refused something by the API server (the Role lacks a verb):\n%s", p, out)
		}
	}
}
