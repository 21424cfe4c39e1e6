package kube_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider/kube"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/tests/wait"
)

// TestBrokerBinaryOnKubernetes runs the real broker binary with `--provider kubernetes` and the
// test cluster's kubeconfig (the flags of cmd/broker/kube.go, nothing set up in process), on its
// embedded Redis, and uses it over REST and the dataplane as a user does: the sandbox is a pod in
// --namespace labelled with --node, made from --kube-image on a claim of --kube-storage-class, and
// a command runs in it. A missing --kube-image stops the broker at start, naming the flag.
func TestBrokerBinaryOnKubernetes(t *testing.T) {
	c := kube.SharedCluster(t)
	ctx := t.Context()
	root, err := kubetest.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "broker")
	build := exec.Command("go", "build", "-o", bin, "./cmd/broker")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the broker: %v\n%s", err, out)
	}
	env := append(os.Environ(), "HOME="+dir, "XDG_CONFIG_HOME=", "SBCTL_CONFIG="+filepath.Join(dir, "sbctl.yaml"),
		"SBX_API_KEY=", "SBX_BROKER_URL=")

	// Without the sandbox image the flags are refused before anything starts.
	bad := exec.CommandContext(ctx, bin, "--data-dir", filepath.Join(dir, "bad"), "--provider", "kubernetes", "--kubeconfig", c.Kubeconfig)
	bad.Env = env
	if out, err := bad.CombinedOutput(); err == nil || !strings.Contains(string(out), "kube-image") {
		t.Errorf("--provider kubernetes without --kube-image: %v, output %s (want a refusal naming --kube-image)", err, out)
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	const node = "node-kbin"
	cmd := exec.Command(bin, "--listen", addr, "--data-dir", filepath.Join(dir, "data"), "--node", node,
		"--provider", "kubernetes", "--kubeconfig", c.Kubeconfig, "--namespace", "default",
		"--kube-image", kubetest.SandboxImage, "--kube-pull-policy", "Never", "--kube-storage-class", kubetest.StorageClass)
	cmd.Env = env
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	stop := func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
			t.Errorf("the broker did not stop within 30 s of SIGTERM:\n%s", log.String())
		}
	}
	defer stop()
	url := "http://" + addr
	var ready struct {
		Provider string `json:"provider"`
	}
	if err := wait.For(time.Minute, func() error {
		select {
		case <-exited:
			return nil
		default:
		}
		resp, err := http.Get(url + "/readyz")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/readyz: %s", resp.Status)
		}
		return json.NewDecoder(resp.Body).Decode(&ready)
	}); err != nil {
		t.Fatalf("the broker is not ready: %v\n%s", err, log.String())
	}
	select {
	case <-exited:
		t.Fatalf("the broker exited at start:\n%s", log.String())
	default:
	}
	if ready.Provider != kube.Name {
		t.Fatalf("/readyz says provider %q, want %s\n%s", ready.Provider, kube.Name, log.String())
	}
	cfg, err := client.LoadConfig(filepath.Join(dir, "sbctl.yaml"))
	if err != nil || cfg.APIKey == "" {
		t.Fatalf("the broker's first-start config: %v %+v\n%s", err, cfg, log.String())
	}
	cl, err := client.New(url, cfg.APIKey)
	if err != nil {
		t.Fatal(err)
	}

	created, err := cl.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "bin-box"})
	if err != nil {
		t.Fatalf("create: %v\n%s", err, log.String())
	}
	sb := created.Sandbox
	if sb.Status != protocol.StatusRunning || sb.Provider != kube.Name {
		t.Fatalf("created %+v", sb)
	}
	name := kube.PodName(sb.ID)
	pod, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Labels[kube.LabelBroker] != node || pod.Spec.Containers[0].Image != kubetest.SandboxImage {
		t.Errorf("the sandbox's pod: labels %v image %s", pod.Labels, pod.Spec.Containers[0].Image)
	}
	pvc, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil || pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName != kubetest.StorageClass {
		t.Errorf("the sandbox's claim: %v %+v", err, pvc)
	}
	if _, err := c.Client.NetworkingV1().NetworkPolicies("default").Get(ctx, name, metav1.GetOptions{}); err != nil {
		t.Errorf("the sandbox's network policy (--kube-network-policies is on by default): %v", err)
	}
	m, err := cl.Delegate(ctx, "bin-box", protocol.MintRequest{Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "echo in $(hostname)", Combined: true}})
	if err != nil || res.ExitCode != 0 || res.Output == nil || *res.Output != "in "+name+"\n" {
		t.Fatalf("exec: %v %+v", err, res)
	}
	// A shell on the pod's terminal, through the binary's dataplane and the agent.
	screen := &term{}
	sh, err := r.Shell(ctx, backend.ShellRequest{ShellArgs: protocol.ShellArgs{Rows: 20, Cols: 70}, Output: screen})
	if err != nil {
		t.Fatal(err)
	}
	sh.Write([]byte("stty size; exit 6\n"))
	select {
	case <-sh.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the shell did not end")
	}
	if shRes, err := sh.Wait(); err != nil || shRes.ExitCode != 6 || !strings.Contains(screen.String(), "20 70\r\n") {
		t.Fatalf("shell: %v %+v %q", err, shRes, screen.String())
	}
	r.Close()
	if _, err := cl.DeleteSandbox(ctx, "bin-box"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the pod after delete: %v", err)
	}
	stop()
	if !strings.Contains(log.String(), "kube-agent-from") {
		t.Errorf("a broker outside the cluster without --kube-agent-from must warn that its policies admit any source:\n%s", log.String())
	}
}
