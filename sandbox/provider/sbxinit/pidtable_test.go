package sbxinit

import (
	"testing"

	"golang.org/x/sys/unix"
)

// TestPidTable: what the init puts, the broker gets through its own mapping, and only for the
// request that put it; the table cannot be resized from the init's side.
func TestPidTable(t *testing.T) {
	broker, fd, err := NewPidTable()
	if err != nil {
		t.Fatal(err)
	}
	defer broker.Close()
	defer unix.Close(fd)
	init, err := OpenPidTable(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer init.Close()

	if _, ok := broker.Get(7); ok {
		t.Error("an empty slot must hold no pid")
	}
	init.Put(7, 42)
	if pid, ok := broker.Get(7); !ok || pid != 42 {
		t.Errorf("Get(7) = %d, %v; want 42", pid, ok)
	}
	// A later request on the same slot replaces it: the earlier one's pid is gone, not another's.
	init.Put(7+PidSlots, 43)
	if pid, ok := broker.Get(7); ok {
		t.Errorf("Get(7) after its slot was reused = %d, want none", pid)
	}
	if pid, ok := broker.Get(7 + PidSlots); !ok || pid != 43 {
		t.Errorf("Get(7+PidSlots) = %d, %v; want 43", pid, ok)
	}
	for _, size := range []int64{0, pidTableSize * 2} {
		if err := unix.Ftruncate(fd, size); err == nil {
			t.Errorf("the table could be resized to %d bytes", size)
		}
	}
	if _, err := OpenPidTable(int(devNull(t))); err == nil {
		t.Error("a file that is not a table must be refused")
	}
}

func devNull(t *testing.T) uintptr {
	fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return uintptr(fd)
}
