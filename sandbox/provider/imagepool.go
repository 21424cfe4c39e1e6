package provider

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// The image pool: a few workspace images made ahead, each copied from its base image, attached to a
// loop device and mounted, so that a create takes one and moves its mount onto the new workspace
// (a mount move, ~0.01 ms) instead of copying, attaching and mounting on its path (~2 ms quiet, 4 ms
// and more at p90 under load). Images, not sandboxes: a pooled image is an empty filesystem that
// belongs to nobody until a create takes it, and gets its owner (secure) there, as a fresh one does.
//
// The images wait in <DataDir>/disk-images/pool, mounted on directories in its mnt/, which is made a
// private mount of itself: on a shared data dir (systemd's default) a pooled image would otherwise
// propagate into every other view of it (TestDiskImagePoolSharedDataDir), and mount(2) documents
// that a mount under a shared parent cannot be moved (6.18 moves it anyway). The image
// files stay outside that mount, on the data dir's, where a rename reaches the sandbox's directory.
// The pool holds imagePoolSize images of the size the last create asked for, and is refilled in the
// background once each create's sandbox has started (oweRefill). A broker that stops closes it
// (Namespace.Close); what a crashed one left there (mounts, images) is removed at the next start.
const imagePoolSize = 2

type imagePool struct {
	dir string

	mu      sync.Mutex
	size    ByteSize // the size the pool makes: the last one a create asked for
	ready   []pooledImage
	seq     int
	filling bool
	closed  bool
	staged  bool          // mnts() is the private mount
	idle    chan struct{} // closed when the last fill started has ended; nil before the first
	// owed are the refills that creates left for when their sandbox's start has ended, by sandbox
	// id (oweRefill).
	owed map[string]ByteSize
}

// pooledImage is an image file in the pool and the directory its filesystem is mounted on.
type pooledImage struct{ img, mnt string }

// pools are the live pools by directory, for UnmountUnder: whoever removes a data dir stops its pool
// first, so that no fill mounts an image in it while it goes.
var pools sync.Map // dir → *imagePool

// initImagePool removes what an earlier broker on this data dir left in the pool and sets up an
// empty one. It runs only where disk quotas are enforced.
func (n *Namespace) initImagePool() {
	p := &imagePool{dir: filepath.Join(n.vol.imagesDir, "pool")}
	removePool(p.dir)
	n.vol.pool = p
	pools.Store(p.dir, p)
}

// Close unmounts and removes the images the provider made ahead (its image pool): they belong to
// no sandbox. Sandboxes' own workspaces stay as they are. Whoever made the provider closes it, last.
func (n *Namespace) Close() {
	if n.vol.pool != nil {
		n.vol.pool.close()
	}
}

// removePool detaches every mount in the pool dir and removes its files.
func removePool(dir string) {
	UnmountUnder(dir)
	_ = os.RemoveAll(dir)
}

// take hands out a pooled image of the given size, if one is ready. It never waits for one.
func (p *imagePool) take(size ByteSize) (pooledImage, bool) {
	if p == nil {
		return pooledImage{}, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || len(p.ready) == 0 || p.size != size {
		return pooledImage{}, false
	}
	pi := p.ready[len(p.ready)-1]
	p.ready = p.ready[:len(p.ready)-1]
	return pi, true
}

// oweRefill notes that the create of sandbox id used the pool (or made its image of size on its
// path) and leaves the refill for when that sandbox's start ends (payRefill): a fill copies,
// attaches and mounts an image, kernel work that on a loaded host's few cores slowed the very start
// it was refilling for (bwrap's namespaces and mounts, the init's start). A create whose sandbox
// never starts pays it at its destroy.
func (n *Namespace) oweRefill(id string, size ByteSize) {
	p := n.vol.pool
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.owed == nil {
		p.owed = map[string]ByteSize{}
	}
	p.owed[id] = size
}

// payRefill starts the refill the create of sandbox id left, if it left one.
func (n *Namespace) payRefill(id string) {
	p := n.vol.pool
	if p == nil {
		return
	}
	p.mu.Lock()
	size, owed := p.owed[id]
	delete(p.owed, id)
	p.mu.Unlock()
	if owed {
		n.refillPool(size)
	}
}

// refillPool tops the pool up to imagePoolSize images of size in the background; a pool of another
// size is emptied first. At most one fill runs at a time.
func (n *Namespace) refillPool(size ByteSize) {
	p := n.vol.pool
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	if p.size != size {
		for _, pi := range p.ready {
			discardPooled(pi)
		}
		p.ready, p.size = nil, size
	}
	if p.filling || len(p.ready) >= imagePoolSize {
		return
	}
	p.filling, p.idle = true, make(chan struct{})
	go n.fillPool(p, p.idle)
}

// fillPool makes images until the pool is full, closed, or a make fails; it closes idle when it ends.
func (n *Namespace) fillPool(p *imagePool, idle chan struct{}) {
	defer close(idle)
	for {
		p.mu.Lock()
		if p.closed || len(p.ready) >= imagePoolSize {
			p.filling = false
			p.mu.Unlock()
			return
		}
		size, seq := p.size, p.seq
		p.seq++
		p.mu.Unlock()
		pi, err := n.poolImage(p, size, seq)
		p.mu.Lock()
		if err != nil || p.closed {
			p.filling = false
			p.mu.Unlock()
			if err == nil {
				discardPooled(pi)
			} else {
				// Creates go on without the pool, as they did before it.
				n.vol.log.Debug("disk image pool: not refilled", "err", err)
			}
			return
		}
		if size != p.size {
			// A create asked for another size meanwhile: the pool makes that one now.
			p.mu.Unlock()
			discardPooled(pi)
			continue
		}
		p.ready = append(p.ready, pi)
		p.mu.Unlock()
	}
}

// poolImage makes one image for the pool: copied from the base image, attached, mounted in the
// pool, with no lost+found (the workspace starts empty). The data dir's reserve applies as to a
// create: the pool never takes the space the broker keeps for itself.
func (n *Namespace) poolImage(p *imagePool, size ByteSize, seq int) (pooledImage, error) {
	if err := checkReserve(n.cfg.DataDir, n.vol.reserve); err != nil {
		return pooledImage{}, err
	}
	if err := p.stage(); err != nil {
		return pooledImage{}, err
	}
	base, err := n.baseImage(size)
	if err != nil {
		return pooledImage{}, err
	}
	name := strconv.Itoa(seq)
	pi := pooledImage{img: filepath.Join(p.dir, name+".img"), mnt: filepath.Join(p.mnts(), name)}
	if err := copySparse(base, pi.img, int64(size)); err != nil {
		os.Remove(pi.img)
		return pooledImage{}, err
	}
	if err := os.Mkdir(pi.mnt, 0o700); err != nil {
		os.Remove(pi.img)
		return pooledImage{}, err
	}
	if err := loopAttachMount(pi.img, pi.mnt, volumeFlags); err != nil {
		os.Remove(pi.mnt)
		os.Remove(pi.img)
		return pooledImage{}, err
	}
	_ = os.Remove(filepath.Join(pi.mnt, "lost+found"))
	return pi, nil
}

// mnts is where pooled images are mounted: a private mount of itself (stage).
func (p *imagePool) mnts() string { return filepath.Join(p.dir, "mnt") }

// stage makes the pool's mount directory a private mount of itself, once.
func (p *imagePool) stage() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.staged {
		return nil
	}
	m := p.mnts()
	if err := os.MkdirAll(m, 0o700); err != nil {
		return err
	}
	if err := unix.Mount(m, m, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", m, err)
	}
	if err := unix.Mount("", m, "", unix.MS_PRIVATE, ""); err != nil {
		_ = unix.Unmount(m, unix.MNT_DETACH)
		return fmt.Errorf("make %s private: %w", m, err)
	}
	p.staged = true
	return nil
}

// close stops the pool: it waits for a fill under way, then removes every pooled image and the
// pool's mount. Creates then make their images on their path.
func (p *imagePool) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.settle()
	p.mu.Lock()
	p.ready = nil
	p.mu.Unlock()
	pools.CompareAndDelete(p.dir, p)
	removePool(p.dir)
}

// settle waits until no fill runs.
func (p *imagePool) settle() {
	p.mu.Lock()
	idle := p.idle
	p.mu.Unlock()
	if idle != nil {
		<-idle
	}
}

// discardPooled unmounts a pooled image (its loop device goes with it: autoclear) and removes it.
func discardPooled(pi pooledImage) {
	_ = unix.Unmount(pi.mnt, unix.MNT_DETACH)
	_ = os.Remove(pi.mnt)
	_ = os.Remove(pi.img)
}

// adoptPooled moves a pooled image's mount onto the sandbox's empty workspace and its file to the
// sandbox's image path. On failure the workspace is as it was and the image is gone.
func (n *Namespace) adoptPooled(id string, pi pooledImage) error {
	img, ws := n.layout.diskImage(id), n.layout.workspaceDir(id)
	n.vol.mu.Lock()
	defer n.vol.mu.Unlock()
	err := unix.Mount(pi.mnt, ws, "", unix.MS_MOVE, "")
	if err != nil {
		discardPooled(pi)
		return fmt.Errorf("move %s: %w", pi.mnt, err)
	}
	_ = os.Remove(pi.mnt)
	// The loop device follows its file: the image is found by this path from now on (boundLoop).
	if err := os.Rename(pi.img, img); err != nil {
		_ = unix.Unmount(ws, unix.MNT_DETACH)
		_ = os.Remove(pi.img)
		return err
	}
	return nil
}

// stopPoolsUnder closes the pools of the data dirs under dir (UnmountUnder).
func stopPoolsUnder(dir string) {
	pools.Range(func(k, v any) bool {
		if d := k.(string); d == dir || strings.HasPrefix(d, dir+"/") {
			v.(*imagePool).close()
		}
		return true
	})
}
