package provider

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
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
