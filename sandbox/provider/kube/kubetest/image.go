package kubetest

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path"
	"runtime"
	"sort"
	"time"
)

// Image is a one-layer image written as a docker-archive tar (manifest.json, a config and a
// layer.tar), the format `ctr images import` reads. No registry is needed: the cluster's pods use
// imagePullPolicy Never.
type Image struct {
	Tag        string
	Entrypoint []string
	Env        []string
	files      map[string]imageFile
}

type imageFile struct {
	mode    int64
	data    []byte
	link    string // a symlink's target
	dir     bool
	srcPath string // read at write time
}

// NewImage starts an image tagged tag (registry/name:version).
func NewImage(tag string, entrypoint ...string) *Image {
	return &Image{Tag: tag, Entrypoint: entrypoint, files: map[string]imageFile{}}
}

// AddFile copies the host file src into the image at dst with mode.
func (im *Image) AddFile(dst, src string, mode int64) {
	im.files[dst] = imageFile{mode: mode, srcPath: src}
}

// AddData puts data at dst with mode.
func (im *Image) AddData(dst string, data []byte, mode int64) {
	im.files[dst] = imageFile{mode: mode, data: data}
}

// AddDir makes the directory dst.
func (im *Image) AddDir(dst string, mode int64) { im.files[dst] = imageFile{mode: mode, dir: true} }

// AddLink makes the symlink dst pointing at target.
func (im *Image) AddLink(dst, target string) { im.files[dst] = imageFile{mode: 0o777, link: target} }

// layer is the image's one layer: parents before children, every parent directory present.
func (im *Image) layer() ([]byte, error) {
	all := map[string]imageFile{}
	for p, f := range im.files {
		all[p] = f
		for d := path.Dir(p); d != "/" && d != "."; d = path.Dir(d) {
			if _, ok := all[d]; !ok {
				if _, ok := im.files[d]; !ok {
					all[d] = imageFile{mode: 0o755, dir: true}
				}
			}
		}
	}
	names := make([]string, 0, len(all))
	for p := range all {
		names = append(names, p)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	for _, p := range names {
		f := all[p]
		h := &tar.Header{Name: p[1:], Mode: f.mode, ModTime: epoch, Format: tar.FormatPAX}
		switch {
		case f.dir:
			h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
		case f.link != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f.link
		default:
			data := f.data
			if f.srcPath != "" {
				var err error
				if data, err = os.ReadFile(f.srcPath); err != nil {
					return nil, err
				}
			}
			h.Typeflag, h.Size = tar.TypeReg, int64(len(data))
			if err := tw.WriteHeader(h); err != nil {
				return nil, err
			}
			if _, err := tw.Write(data); err != nil {
				return nil, err
			}
			continue
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// WriteArchive writes the image as a docker-archive tar to w.
func (im *Image) WriteArchive(w io.Writer) error {
	layer, err := im.layer()
	if err != nil {
		return err
	}
	sum := sha256.Sum256(layer)
	diffID := "sha256:" + hex.EncodeToString(sum[:])
	cfg, err := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"created":      time.Unix(0, 0).UTC(),
		"config":       map[string]any{"Entrypoint": im.Entrypoint, "Env": im.Env},
		"rootfs":       map[string]any{"type": "layers", "diff_ids": []string{diffID}},
	})
	if err != nil {
		return err
	}
	csum := sha256.Sum256(cfg)
	cfgName := hex.EncodeToString(csum[:]) + ".json"
	layerName := hex.EncodeToString(sum[:]) + "/layer.tar"
	manifest, err := json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": []string{im.Tag}, "Layers": []string{layerName}}})
	if err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	for _, e := range []struct {
		name string
		data []byte
	}{{cfgName, cfg}, {layerName, layer}, {"manifest.json", manifest}} {
		if dir := path.Dir(e.name); dir != "." {
			if err := tw.WriteHeader(&tar.Header{Name: dir + "/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: time.Unix(0, 0)}); err != nil {
				return err
			}
		}
		if err := tw.WriteHeader(&tar.Header{Name: e.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(e.data)), ModTime: time.Unix(0, 0)}); err != nil {
			return err
		}
		if _, err := tw.Write(e.data); err != nil {
			return err
		}
	}
	return tw.Close()
}

// WriteArchiveFile writes the image's docker-archive tar to file.
func (im *Image) WriteArchiveFile(file string) error {
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if err := im.WriteArchive(f); err != nil {
		f.Close()
		return fmt.Errorf("image %s: %w", im.Tag, err)
	}
	return f.Close()
}
