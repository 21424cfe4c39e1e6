// Command pause is the test cluster's pod sandbox image (tagged registry.k8s.io/pause:3.10, which
// containerd's CRI runs first in every pod): it holds the pod's namespaces until SIGTERM or SIGINT,
// and, as process 1 of a pod that shares its process namespace, reaps the orphans that end. Build it
// with CGO_ENABLED=0: the image holds nothing else.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
