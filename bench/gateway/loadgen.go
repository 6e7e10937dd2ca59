package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// upstreamBody is what the benchmark upstream answers.
var upstreamBody = []byte(`{"ok":true,"message":"hello from the benchmark upstream"}`)

// upstreamHandler is the benchmark upstream: a small JSON answer.
func upstreamHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write(upstreamBody)
	})
}

// loadResult is one load run: the latency histogram, completed and failed
// requests, and the CPU time the load generator's process spent during the
// run (0 when the generator runs in the gateway's process: it cannot be
// told apart there).
type loadResult struct {
	h       *hdrhistogram.Histogram
	n, errs int64
	cpu     time.Duration
}

// loadGen drives a base URL with conc workers for d, closed-loop (rate 0)
// or open-loop at rate requests/s in all. The upstream the proxies forward
// to lives beside it (in the same process).
type loadGen interface {
	upstream() string
	run(base string, d time.Duration, conc, rate int) (loadResult, error)
	close()
}

// inprocLoad is the load generator and upstream in the gateway's process
// (-loadgen inprocess): their CPU counts as the gateway's.
type inprocLoad struct {
	up     string
	stopUp func()
}

func newInprocLoad() (*inprocLoad, error) {
	up, stop, err := serve(upstreamHandler())
	if err != nil {
		return nil, err
	}
	return &inprocLoad{up: up, stopUp: stop}, nil
}

func (l *inprocLoad) upstream() string { return l.up }
func (l *inprocLoad) close()           { l.stopUp() }
func (l *inprocLoad) run(base string, d time.Duration, conc, rate int) (loadResult, error) {
	h, n, errs := load(base, d, conc, rate)
	return loadResult{h: h, n: n, errs: errs}, nil
}

// procLoad is the load generator and upstream in a child process
// (-loadgen process): the gateway process then holds only the proxies and
// the agent, and each side's CPU time is measured separately. The child
// prints "upstream <url>", then answers each "run <url> <ns> <conc> <rate>" line
// on stdin with one JSON line (loadReply).
type procLoad struct {
	up    string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
}

// loadReply is the child's answer to one run.
type loadReply struct {
	N, Errs int64
	CPU     time.Duration
	Hist    *hdrhistogram.Snapshot
	Err     string `json:",omitempty"`
}

// spawnLoad re-executes this program as the load generator child, under
// taskset -c cpus when cpus is set.
func spawnLoad(cpus string) (*procLoad, error) {
	cmd, stdin, out, err := spawnChild("-loadgen-child", "-loadgen-cpus", cpus, 1<<20)
	if err != nil {
		return nil, err
	}
	l := &procLoad{cmd: cmd, stdin: stdin, out: out}
	line, err := l.out.ReadString('\n')
	if _, serr := fmt.Sscanf(line, "upstream %s", &l.up); err != nil || serr != nil {
		l.close()
		return nil, fmt.Errorf("load generator child: %q: %v %v", line, err, serr)
	}
	return l, nil
}

// spawnChild re-executes this program with childFlag (under taskset -c
// cpus when cpus is set; cpusFlag names the flag in errors) and returns it
// started, with its stdin and a reader of bufSize over its stdout; its
// stderr is ours.
func spawnChild(childFlag, cpusFlag, cpus string, bufSize int) (*exec.Cmd, io.WriteCloser, *bufio.Reader, error) {
	args := []string{os.Args[0], childFlag}
	if cpus != "" {
		ts, err := exec.LookPath("taskset")
		if err != nil {
			return nil, nil, nil, fmt.Errorf("%s: %w", cpusFlag, err)
		}
		args = append([]string{ts, "-c", cpus}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, nil, nil, err
	}
	return cmd, stdin, bufio.NewReaderSize(stdout, bufSize), nil
}

func (l *procLoad) upstream() string { return l.up }

func (l *procLoad) run(base string, d time.Duration, conc, rate int) (loadResult, error) {
	if _, err := fmt.Fprintf(l.stdin, "run %s %d %d %d\n", base, int64(d), conc, rate); err != nil {
		return loadResult{}, fmt.Errorf("load generator child: %w", err)
	}
	line, err := l.out.ReadBytes('\n')
	if err != nil {
		return loadResult{}, fmt.Errorf("load generator child: %w", err)
	}
	var rep loadReply
	if err := json.Unmarshal(line, &rep); err != nil {
		return loadResult{}, fmt.Errorf("load generator child: %w", err)
	}
	if rep.Err != "" {
		return loadResult{}, errors.New("load generator child: " + rep.Err)
	}
	if rep.Hist == nil {
		return loadResult{}, errors.New("load generator child: no histogram")
	}
	if err := rep.Hist.Validate(); err != nil {
		return loadResult{}, fmt.Errorf("load generator child: %w", err)
	}
	return loadResult{h: hdrhistogram.Import(rep.Hist), n: rep.N, errs: rep.Errs, cpu: rep.CPU}, nil
}

func (l *procLoad) close() { l.stdin.Close(); _ = l.cmd.Wait() }

// runLoadChild is the child process of -loadgen process: it serves the
// upstream, prints its URL, and runs the load runs asked for on stdin
// until stdin closes (the parent ended, however it ended).
func runLoadChild() error {
	up, stop, err := serve(upstreamHandler())
	if err != nil {
		return err
	}
	defer stop()
	out := bufio.NewWriter(os.Stdout)
	fmt.Fprintf(out, "upstream %s\n", up)
	if err := out.Flush(); err != nil {
		return err
	}
	sc := bufio.NewScanner(os.Stdin)
	enc := json.NewEncoder(out)
	for sc.Scan() {
		var rep loadReply
		var base string
		var ns int64
		var conc, rate int
		if _, err := fmt.Sscanf(sc.Text(), "run %s %d %d %d", &base, &ns, &conc, &rate); err != nil || ns <= 0 || conc < 1 || conc > 4096 || rate < 0 {
			rep.Err = "bad command " + strconv.Quote(sc.Text())
		} else {
			c0 := cpuTime()
			h, n, errs := load(base, time.Duration(ns), conc, rate)
			rep.CPU = cpuTime() - c0
			rep.N, rep.Errs, rep.Hist = n, errs, h.Export()
		}
		if err := enc.Encode(&rep); err != nil {
			return err
		}
		if err := out.Flush(); err != nil {
			return err
		}
	}
	return sc.Err()
}

// load runs conc workers against base for d and returns the latency
// histogram, the completed requests and the failures. With rate 0 each
// worker sends its next request when the last one is answered (closed
// loop: at saturation, latency is mostly queueing, concurrency/throughput).
// With rate > 0 each worker sends on a fixed schedule of rate/conc a
// second and latency counts from the scheduled time, so a late send is
// charged to whatever made it late (no coordinated omission).
func load(base string, d time.Duration, conc, rate int) (*hdrhistogram.Histogram, int64, int64) {
	tr := &http.Transport{MaxIdleConns: conc * 2, MaxIdleConnsPerHost: conc * 2, IdleConnTimeout: 90 * time.Second}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	hs := make([]*hdrhistogram.Histogram, conc)
	var n, errs atomic.Int64
	stop := time.Now().Add(d)
	// The 64 API keys' header values, built once (not per request, which
	// would charge the generator's formatting to whichever target runs).
	keys := make([][]string, 64)
	for i := range keys {
		keys[i] = []string{fmt.Sprintf("k_bench_%02d", i)}
	}
	var interval time.Duration
	if rate > 0 {
		interval = time.Duration(int64(time.Second) * int64(conc) / int64(rate))
	}
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < conc; w++ {
		hs[w] = hdrhistogram.New(1, int64(10*time.Second/time.Nanosecond), 3)
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			req, _ := http.NewRequest(http.MethodGet, base+"/v1/search", nil)
			for i := 0; ; i++ {
				t0 := time.Now()
				if interval > 0 {
					// Worker w's i-th slot, the workers staggered evenly.
					t0 = start.Add(time.Duration(i)*interval + time.Duration(w)*interval/time.Duration(conc))
					if wait := time.Until(t0); wait > 0 {
						time.Sleep(wait)
					}
				}
				if t0.After(stop) {
					return
				}
				req.Header["X-Api-Key"] = keys[(w*7+i)%64]
				resp, err := client.Do(req)
				if err != nil {
					errs.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				_ = hs[w].RecordValue(int64(time.Since(t0)))
				n.Add(1)
			}
		}(w)
	}
	wg.Wait()
	h := hs[0]
	for _, o := range hs[1:] {
		h.Merge(o)
	}
	return h, n.Load(), errs.Load()
}
