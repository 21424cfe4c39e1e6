package sbxinit

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PidTable is memory shared by the broker and the init, where the init writes each command's pid
// as it forks it. The broker reads it only when it must end a command without the init (the init
// stopped answering: provider/outside.go), so the pid needs no message of its own: a `forked`
// reply per exec cost the init a send and the broker a wakeup while the command ran.
//
// Slot id%PidSlots holds the low 32 bits of the request's id beside the pid, so a slot reused by
// a later request is never read as this one's; the broker never has two requests in flight on
// one slot. The broker creates it sealed at its size: an init that tried to shrink it cannot make
// the broker fault on it.
type PidTable struct {
	mem   []byte
	slots *[PidSlots]uint64
}

// PidSlots is how many requests of one sandbox can be in flight at once.
const PidSlots = 4096

const pidTableSize = PidSlots * 8

// PidSlot is the slot of request id.
func PidSlot(id uint64) uint64 { return id % PidSlots }

// NewPidTable creates a table and returns it with the fd to pass to the init (close-on-exec; the
// caller closes it once sent).
func NewPidTable() (*PidTable, int, error) {
	fd, err := unix.MemfdCreate("sandbox-pids", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, fmt.Errorf("pid table: %w", err)
	}
	if err := unix.Ftruncate(fd, pidTableSize); err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("pid table: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("pid table: %w", err)
	}
	t, err := mapPidTable(fd)
	if err != nil {
		unix.Close(fd)
		return nil, -1, err
	}
	return t, fd, nil
}

// OpenPidTable maps the table the broker passed (fd stays the caller's).
func OpenPidTable(fd int) (*PidTable, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Size != pidTableSize {
		return nil, fmt.Errorf("pid table: not a table (%v)", err)
	}
	return mapPidTable(fd)
}

func mapPidTable(fd int) (*PidTable, error) {
	mem, err := unix.Mmap(fd, 0, pidTableSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("pid table: %w", err)
	}
	return &PidTable{mem: mem, slots: (*[PidSlots]uint64)(unsafe.Pointer(&mem[0]))}, nil
}

// Put records request id's command as pid.
func (t *PidTable) Put(id uint64, pid int) {
	atomic.StoreUint64(&t.slots[PidSlot(id)], uint64(uint32(id))<<32|uint64(uint32(pid)))
}

// Get is the pid Put recorded for request id, if its slot still holds it.
func (t *PidTable) Get(id uint64) (int, bool) {
	v := atomic.LoadUint64(&t.slots[PidSlot(id)])
	if v == 0 || uint32(v>>32) != uint32(id) {
		return 0, false
	}
	return int(uint32(v)), true
}

// Close unmaps the table; nothing may use it after.
func (t *PidTable) Close() { unix.Munmap(t.mem) }
