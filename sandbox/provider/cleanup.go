package provider

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"
)

// removeLeftover removes sandbox id's cgroups if any are still there: a stop whose removal gave
// up (a task slow to leave) or a broker that died before removing them. Deleting a sandbox calls
// it so that no cgroup outlives its sandbox until the next broker start's sweep. A cgroup that
// still has tasks is not removed, and the error says so.
func (h *cgroupHost) removeLeftover(id string) error {
	if !validID(id) {
		return fmt.Errorf("%w: %q", ErrInvalidID, id)
	}
	var dirs []string
	for _, parent := range h.parents {
		dir := filepath.Join(parent, id)
		if _, err := os.Stat(dir); err == nil {
			dirs = append(dirs, dir)
		}
	}
	if len(dirs) == 0 {
		return nil
	}
	// A v2 set shares one dir across controllers; remove skips the ones already gone.
	seen := map[string]bool{}
	s := &cgroupSet{}
	for _, d := range dirs {
		if !seen[d] {
			seen[d] = true
			s.dirs = append(s.dirs, d)
		}
	}
	if err := s.remove(); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// orphanEnv names the environment variable every bwrap of a namespace provider starts with (and
// passes on to the sandbox's init). Its value identifies the data dir, so a provider finds the
// processes a previous broker on the same data dir left and no other broker's. It is a hash: the
// init's environment is readable inside the sandbox, and a host path must not be.
const orphanEnv = "SBX_SANDBOX_OF"

// orphanValue is the marker's value for a data dir: a hash of its path.
func orphanValue(dataDir string) string {
	sum := sha256.Sum256([]byte(filepath.Clean(dataDir)))
	return hex.EncodeToString(sum[:8])
}

// orphanMarker is this provider's "SBX_SANDBOX_OF=<hash of the data dir>" environment entry.
func orphanMarker(dataDir string) string { return orphanEnv + "=" + orphanValue(dataDir) }

// reapOrphans ends every process carrying marker in its environment: bwraps and inits that a broker
// killed while it was starting them left behind (bubblewrap's --die-with-parent and the Pdeathsig
// are set in the child a moment after it exists; a kill -9 of the broker in that moment orphans it,
// bubblewrap issue 633). It runs when a provider starts, before it runs any sandbox of its own, so
// every marked process is an orphan: a sandbox the broker recovers is started afresh. Each process
// is opened as a pidfd before its environment is read, so a pid reused meanwhile is never
// signalled. It returns how many it ended.
func reapOrphans(marker string) int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	self := os.Getpid()
	want := []byte(marker)
	n := 0
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self || pid <= 1 {
			continue
		}
		fd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			continue
		}
		env, err := os.ReadFile("/proc/" + e.Name() + "/environ")
		if err == nil && slices.ContainsFunc(bytes.Split(env, []byte{0}), func(kv []byte) bool { return bytes.Equal(kv, want) }) {
			if unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0) == nil {
				n++
			}
		}
		unix.Close(fd)
	}
	return n
}
