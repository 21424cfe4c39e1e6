package kube

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
)

// The package's tests share one real single-node cluster, started by the first test that needs it
// and stopped (and checked for leftovers) when the tests end.
var (
	clusterOnce sync.Once
	shared      *kubetest.Cluster
	clusterErr  error
)

func cluster(t testing.TB) *kubetest.Cluster {
	t.Helper()
	clusterOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		start := time.Now()
		shared, clusterErr = kubetest.Start(ctx)
		if clusterErr == nil {
			fmt.Fprintf(os.Stderr, "kubetest: cluster up in %s (state in %s)\n", time.Since(start).Round(time.Millisecond), shared.Dir)
		}
	})
	if clusterErr != nil {
		t.Fatal(clusterErr)
	}
	return shared
}

func TestMain(m *testing.M) {
	// The benchmark runs namespace sandboxes beside pods: the test binary doubles as their init.
	if len(os.Args) > 1 && os.Args[1] == provider.InitArg {
		provider.RunInit()
	}
	code := m.Run()
	if shared != nil {
		if err := shared.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "kubetest: stopping the cluster:", err)
			code = 1
		}
		if left := kubetest.Leftovers(); len(left) > 0 {
			fmt.Fprintln(os.Stderr, "kubetest: the stopped cluster left", left)
			code = 1
		}
	}
	os.Exit(code)
}
