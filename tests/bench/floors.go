package main

// The floors under the dataplane rows: loopback TCP round trips (within one process and to another
// process) and bytes between a socket and a file, with no protocol at all.

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"time"
)

// tcpRoundTrips measures a 1-byte ping-pong over loopback TCP: the floor under any dataplane.
func tcpRoundTrips(n int) (samples, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return samples{}, err
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b := make([]byte, 1)
		for {
			if _, err := c.Read(b); err != nil {
				return
			}
			c.Write(b)
		}
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		return samples{}, err
	}
	defer c.Close()
	return pingPong(c, n), nil
}

// pingPong times n one-byte round trips on c.
func pingPong(c net.Conn, n int) samples {
	b := make([]byte, 1)
	return sample(n, func() error {
		if _, err := c.Write(b); err != nil {
			return err
		}
		_, err := c.Read(b)
		return err
	})
}

// tcpEchoEnv makes the bench's binary a TCP echo server (tcpRoundTripsAcross).
const tcpEchoEnv = "SBX_BENCH_TCP_ECHO"

// tcpRoundTripsAcross measures a 1-byte ping-pong over loopback TCP with another process: the floor
// under any dataplane round trip, which always crosses from the client's process to the broker's.
// Each way wakes a thread of the other process, on this virtual machine often on an idle vCPU;
// tcpRoundTrips' two goroutines of one process can hand the byte over on one thread.
func tcpRoundTripsAcross(n int) (samples, error) {
	c, end, err := echoProcess("", "")
	if err != nil {
		return samples{}, err
	}
	defer end()
	return pingPong(c, n), nil
}

// tcpFileReadsAcross measures n reads of the file at path from another process over loopback TCP,
// each into a new buffer as a client's read is: the floor under a dataplane read, which always
// crosses from the broker's process to the client's (a local read copies the page cache once; this
// copies it into the other process's buffer, then through the socket, then out of it).
func tcpFileReadsAcross(n int, path string) (samples, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return samples{}, err
	}
	c, end, err := echoProcess(path, "")
	if err != nil {
		return samples{}, err
	}
	defer end()
	ask := []byte{echoFileByte}
	return sample(n, func() error {
		if _, err := c.Write(ask); err != nil {
			return err
		}
		_, err := io.ReadFull(c, make([]byte, fi.Size()))
		return err
	}), nil
}

// tcpExecsAcross measures n execs of `true` by another process, asked over loopback TCP and
// answered when it has exited: bare os/exec plus the two wakeups any exec served by a daemon pays.
func tcpExecsAcross(n int) (samples, error) {
	c, end, err := echoProcess("", "")
	if err != nil {
		return samples{}, err
	}
	defer end()
	b := []byte{echoExecByte}
	return sample(n, func() error {
		if _, err := c.Write(b); err != nil {
			return err
		}
		_, err := io.ReadFull(c, b)
		return err
	}), nil
}

// tcpWriteReadsAcross measures n 4 KiB write+reads by another process in dir, asked over loopback
// TCP: the write (its content sent with the ask) as atomicWrite does it, answered once renamed,
// then the file read back and sent. Two round trips and the file work, as a dataplane write+read.
func tcpWriteReadsAcross(n int, dir string) (samples, error) {
	c, end, err := echoProcess("", dir)
	if err != nil {
		return samples{}, err
	}
	defer end()
	ask := append([]byte{echoWriteByte}, bytes.Repeat([]byte("x"), echoSmall)...)
	got := make([]byte, echoSmall)
	return sample(n, func() error {
		if _, err := c.Write(ask); err != nil {
			return err
		}
		if _, err := io.ReadFull(c, got[:1]); err != nil {
			return err
		}
		if _, err := c.Write([]byte{echoReadByte}); err != nil {
			return err
		}
		_, err := io.ReadFull(c, got)
		return err
	}), nil
}

// echoProcess starts the bench's binary as a TCP echo server (tcpEcho) and connects to it; file,
// when set, is what the server sends for an echoFileByte, dir where it writes for an echoWriteByte.
func echoProcess(file, dir string) (c net.Conn, end func(), err error) {
	self, err := os.Executable()
	if err != nil {
		return nil, nil, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), tcpEchoEnv+"=1", tcpEchoFileEnv+"="+file, tcpEchoDirEnv+"="+dir)
	stdin, err := cmd.StdinPipe() // the echo server ends when the bench closes it, or exits
	if err != nil {
		return nil, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	stop := func() { stdin.Close(); cmd.Wait() }
	var addr string
	if _, err := fmt.Fscanln(stdout, &addr); err != nil {
		stop()
		return nil, nil, fmt.Errorf("the TCP echo process: %w", err)
	}
	if c, err = net.Dial("tcp", addr); err != nil {
		stop()
		return nil, nil, err
	}
	return c, func() { c.Close(); stop() }, nil
}

const (
	// tcpEchoFileEnv names the file the echo process sends for an echoFileByte.
	tcpEchoFileEnv = "SBX_BENCH_TCP_ECHO_FILE"
	// tcpEchoDirEnv names the directory the echo process writes in for an echoWriteByte.
	tcpEchoDirEnv = "SBX_BENCH_TCP_ECHO_DIR"
	// echoFileByte asks the echo process for its file, read then (pread into a buffer it keeps, one
	// write), as a server answering a read does.
	echoFileByte = 'F'
	// echoExecByte asks it to run `true` and answer (the byte back) when it has exited.
	echoExecByte = 'X'
	// echoWriteByte, followed by echoSmall bytes, asks it to write them to a file in its directory
	// (atomicWrite) and answer a byte; echoReadByte to read that file and send it.
	echoWriteByte = 'W'
	echoReadByte  = 'R'
	echoSmall     = 4096
)

// tcpEcho serves echoProcess: it prints its address, echoes each byte of one connection (or sends
// its file for an echoFileByte), and exits when its standard input closes.
func tcpEcho() {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "tcp echo:", err)
		os.Exit(1)
	}
	fmt.Println(l.Addr().String())
	go func() {
		io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	var file *os.File
	var buf []byte
	if p := os.Getenv(tcpEchoFileEnv); p != "" {
		if file, err = os.Open(p); err != nil {
			fmt.Fprintln(os.Stderr, "tcp echo:", err)
			os.Exit(1)
		}
		fi, _ := file.Stat()
		buf = make([]byte, fi.Size())
	}
	c, err := l.Accept()
	if err != nil {
		os.Exit(1)
	}
	dir := os.Getenv(tcpEchoDirEnv)
	small := make([]byte, echoSmall)
	b := make([]byte, 1)
	for {
		if _, err := c.Read(b); err != nil {
			os.Exit(0)
		}
		switch {
		case b[0] == echoFileByte && file != nil:
			n, _ := file.ReadAt(buf, 0)
			c.Write(buf[:n])
		case b[0] == echoExecByte:
			exec.Command("true").Run()
			c.Write(b)
		case b[0] == echoWriteByte && dir != "":
			if _, err := io.ReadFull(c, small); err != nil {
				os.Exit(0)
			}
			if err := atomicWrite(filepath.Join(dir, "small"), small); err != nil {
				fmt.Fprintln(os.Stderr, "tcp echo:", err)
				os.Exit(1) // the bench's read then fails, rather than wait for an answer
			}
			c.Write(b)
		case b[0] == echoReadByte && dir != "":
			got, err := os.ReadFile(filepath.Join(dir, "small"))
			if err != nil {
				fmt.Fprintln(os.Stderr, "tcp echo:", err)
				os.Exit(1)
			}
			c.Write(got)
		default:
			c.Write(b)
		}
	}
}

// tcpFileBaselines measures the floor under uploads and downloads on this machine: raw loopback TCP
// into a new file on the data dir's disk, and a file out over raw TCP, with no protocol at all.
func tcpFileBaselines(dir string, size int) (toFile, fromFile float64) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, 0
	}
	defer l.Close()
	path := filepath.Join(dir, "baseline.bin")
	defer os.Remove(path)
	buf := make([]byte, 1<<20)
	done := make(chan struct{})
	go func() { // receive into a new file
		c, err := l.Accept()
		if err != nil {
			return
		}
		f, _ := os.Create(path)
		io.CopyBuffer(f, c, make([]byte, 1<<20))
		f.Close()
		c.Close()
		close(done)
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		return 0, 0
	}
	t := time.Now()
	for sent := 0; sent < size; sent += len(buf) {
		c.Write(buf)
	}
	c.Close()
	<-done
	toFile = float64(size) / (1 << 20) / time.Since(t).Seconds()
	go func() { // send the file
		c, err := l.Accept()
		if err != nil {
			return
		}
		f, _ := os.Open(path)
		io.CopyBuffer(c, struct{ io.Reader }{f}, make([]byte, 1<<20))
		f.Close()
		c.Close()
	}()
	c, err = net.Dial("tcp", l.Addr().String())
	if err != nil {
		return toFile, 0
	}
	t = time.Now()
	io.CopyBuffer(io.Discard, c, buf)
	fromFile = float64(size) / (1 << 20) / time.Since(t).Seconds()
	c.Close()
	return toFile, fromFile
}
