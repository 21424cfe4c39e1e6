package kube_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
	"github.com/sbxbroker/broker/sandbox/provider/kube"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// BenchmarkPodsBesideNamespace measures, in one run, the kubernetes provider on the test cluster
// beside the namespace provider on this host, each op beside its floor (issue 21):
//
//   - create to ready, cold (no pool): floor = a bare pod of the same image created and watched
//     until it runs with an address (the cluster's own start, no claim, no agent);
//   - create to ready from a warm pool (target: p50 under 100 ms for pods): floor = a REST get of
//     the sandbox (one broker round trip);
//   - exec `true` and a 4 KiB write then read over the dataplane: floor = the dataplane's ping
//     (the broker's round trip) and, for pods, a TCP connect to the pod's agent port (one round
//     trip through the pod network).
//
// It prints a table with p50/p99 of each and the load average before and after. Run it alone:
//
//	go test -run '^$' -bench PodsBesideNamespace -benchtime 1x ./sandbox/provider/kube/
func BenchmarkPodsBesideNamespace(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("the namespace provider and the test cluster need root")
	}
	c := kube.SharedCluster(b)
	ctx := context.Background()
	load0 := loadAvg()
	const (
		nCold = 5
		nWarm = 6
		nOps  = 200
		node  = "node-kbench"
	)
	templates := map[string]provider.Template{
		"default": {Name: "default", Pool: provider.Pool{Size: 2}},
		"cold":    {Name: "cold"},
	}
	p, err := kube.New(ctx, kube.Config{
		Client: c.Client, Namespace: "default", Broker: node, Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass, NetworkPolicies: true,
	})
	if err != nil {
		b.Fatal(err)
	}
	kb := servertest.New(b, servertest.Options{ProviderImpl: p, Node: node, Templates: templates})
	nb := servertest.New(b, servertest.Options{Provider: "namespace", Templates: templates})
	type side struct {
		label                                 string
		br                                    *servertest.Broker
		cold, warm, get, exec, rw, ping, tcpc samples
	}
	sides := []*side{{label: "pod", br: kb}, {label: "namespace", br: nb}}
	// The sandboxes go with their claims and secrets when the benchmark ends (a broker stop would
	// keep those of running sandboxes).
	tags := map[string]string{"bench": "kube"}
	defer func() {
		for _, s := range sides {
			if _, err := s.br.Client.DeleteSandboxes(ctx, tags, false); err != nil {
				b.Errorf("%s: deleting the benchmark's sandboxes: %v", s.label, err)
			}
		}
	}()
	for _, s := range sides {
		waitFull(b, s.br, 2)
	}

	// Cold creates, one at a time; a bare pod of the same image beside them.
	var bare samples
	for i := range nCold {
		for _, s := range sides {
			t0 := time.Now()
			if _, err := s.br.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: fmt.Sprintf("cold-%d", i), Template: "cold", Tags: tags}); err != nil {
				b.Fatalf("%s cold create: %v", s.label, err)
			}
			s.cold = append(s.cold, time.Since(t0))
		}
		bare = append(bare, barePodStart(b, c, fmt.Sprintf("bench-bare-%d", i)))
	}
	// Claims from the warm pool, each once the pool is full again (a claim, not a miss).
	for i := range nWarm {
		for _, s := range sides {
			waitFull(b, s.br, 2)
			t0 := time.Now()
			got, err := s.br.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: fmt.Sprintf("warm-%d", i), Tags: tags})
			if err != nil {
				b.Fatalf("%s warm create: %v", s.label, err)
			}
			s.warm = append(s.warm, time.Since(t0))
			t0 = time.Now()
			if _, err := s.br.Client.GetSandbox(ctx, got.Sandbox.ID); err != nil {
				b.Fatal(err)
			}
			s.get = append(s.get, time.Since(t0))
		}
	}
	for _, s := range sides {
		if st := poolOf(s.br); st.Misses != 0 {
			b.Fatalf("%s: the warm creates missed the pool: %+v", s.label, st)
		}
	}
	// The hot path, on the first warm sandbox of each side.
	content := strings.Repeat("x", 4096)
	for _, s := range sides {
		m, err := s.br.Client.Delegate(ctx, "warm-0", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
		if err != nil {
			b.Fatal(err)
		}
		r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
		if err != nil {
			b.Fatal(err)
		}
		var podAddr string
		if s.br == kb {
			pod, err := c.Client.CoreV1().Pods("default").Get(ctx, kube.PodName(m.Sandbox.SandboxID), metav1.GetOptions{})
			if err != nil {
				b.Fatal(err)
			}
			podAddr = net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(agent.Port))
		}
		for range nOps {
			t0 := time.Now()
			if err := r.Ping(ctx); err != nil {
				b.Fatal(err)
			}
			s.ping = append(s.ping, time.Since(t0))
			t0 = time.Now()
			res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "true"}})
			if err != nil || res.ExitCode != 0 {
				b.Fatalf("%s exec: %v %+v", s.label, err, res)
			}
			s.exec = append(s.exec, time.Since(t0))
			t0 = time.Now()
			if _, err := r.Write(ctx, protocol.WriteArgs{Path: "/workspace/4k", Content: content}); err != nil {
				b.Fatal(err)
			}
			if got, err := r.Read(ctx, protocol.ReadArgs{Path: "/workspace/4k"}); err != nil || len(got.Content) != len(content) {
				b.Fatalf("%s read: %v", s.label, err)
			}
			s.rw = append(s.rw, time.Since(t0))
			if podAddr != "" {
				t0 = time.Now()
				conn, err := net.Dial("tcp", podAddr)
				if err != nil {
					b.Fatal(err)
				}
				s.tcpc = append(s.tcpc, time.Since(t0))
				conn.Close()
			}
		}
		r.Close()
	}
	load1 := loadAvg()

	pod, ns := sides[0], sides[1]
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "OP (p50 / p99)\tPOD (kubernetes)\tNAMESPACE\tFLOOR\tTARGET")
	fmt.Fprintf(tw, "create to ready, cold (n=%d)\t%s\t%s\tbare pod running: %s\t\n", nCold, pod.cold, ns.cold, bare)
	fmt.Fprintf(tw, "create to ready, warm pool (n=%d)\t%s\t%s\tREST get: %s (pod broker), %s (namespace)\tpod p50 < 100 ms; namespace < 5 ms\n",
		nWarm, pod.warm, ns.warm, pod.get, ns.get)
	fmt.Fprintf(tw, "exec `true` (n=%d)\t%s\t%s\tdataplane ping: %s (pod), %s (namespace); TCP connect to the pod: %s\tnamespace p50 < 1.0 ms\n",
		nOps, pod.exec, ns.exec, pod.ping, ns.ping, pod.tcpc)
	fmt.Fprintf(tw, "4 KiB write+read (n=%d)\t%s\t%s\t(as above)\tnamespace p50 < 0.2 ms\n", nOps, pod.rw, ns.rw)
	tw.Flush()
	fmt.Printf("load average before %s, after %s\n", load0, load1)
	b.ReportMetric(pod.warm.p50ms(), "pod-claim-p50-ms")
	b.ReportMetric(pod.cold.p50ms(), "pod-cold-p50-ms")
	b.ReportMetric(pod.exec.p50ms(), "pod-exec-p50-ms")
	b.ReportMetric(pod.rw.p50ms(), "pod-4k-rw-p50-ms")
}

// samples are durations of one op.
type samples []time.Duration

func (s samples) pct(p float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	c := slices.Clone(s)
	slices.Sort(c)
	return c[min(len(c)-1, int(p*float64(len(c))))]
}

func (s samples) p50ms() float64 { return float64(s.pct(0.5).Microseconds()) / 1000 }

func (s samples) String() string {
	ms := func(d time.Duration) string { return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 2, 64) }
	return ms(s.pct(0.5)) + " / " + ms(s.pct(0.99)) + " ms"
}

func poolOf(b *servertest.Broker) sandbox.PoolStat {
	for _, s := range b.Manager.PoolStats() {
		if s.Template == "default" {
			return s
		}
	}
	return sandbox.PoolStat{}
}

func waitFull(t testing.TB, b *servertest.Broker, n int) {
	t.Helper()
	wait.Eventually(t, 3*time.Minute, func() bool { return poolOf(b).Ready == n }, "the pool holds %d (it has %+v)", n, poolOf(b))
}

// barePodStart creates a pod of the sandbox image (no claim, no secret, no agent handshake),
// watches it until its container runs with an address, deletes it, and answers how long the
// start took: the cluster's own floor under a cold create.
func barePodStart(t testing.TB, c *kubetest.Cluster, name string) time.Duration {
	t.Helper()
	ctx := context.Background()
	pods := c.Client.CoreV1().Pods("default")
	grace := int64(0)
	t0 := time.Now()
	pod, err := pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{RestartPolicy: corev1.RestartPolicyNever, TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{Name: "c", Image: kubetest.SandboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sleep", "3600"}}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &grace})
	w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name, ResourceVersion: pod.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	timeout := time.After(2 * time.Minute)
	for {
		select {
		case ev := <-w.ResultChan():
			if p, ok := ev.Object.(*corev1.Pod); ok && ev.Type != watch.Deleted && p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "" {
				return time.Since(t0)
			}
		case <-timeout:
			t.Fatalf("bare pod %s not running after 2 minutes", name)
		}
	}
}

// loadAvg is the 1, 5 and 15 minute load averages.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
