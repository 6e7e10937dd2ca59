package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/allot/allot/internal/proccpu"
)

// wrkLoad drives the targets with wrk (-loadgen wrk), a C load generator:
// closed loop, conc connections over min(conc, 2) threads,
// the same 64 API keys as the Go generator. The upstream stays in the Go
// child process (procLoad, idle between runs); "client CPU" is wrk's CPU
// plus the upstream child's during the run.
type wrkLoad struct {
	up     *procLoad
	bin    string
	script string
}

// wrkScript cycles the 64 API keys (requests prebuilt in init, so the
// per-request cost is one table lookup) and prints the run's count, errors
// and latency percentiles in 0.1% steps for the harness to parse.
const wrkScript = `
local reqs = {}
local i = 0
init = function(args)
  for k = 0, 63 do
    reqs[k] = wrk.format("GET", "/v1/search", {["X-Api-Key"] = string.format("k_bench_%02d", k)})
  end
  i = math.random(0, 63)
end
request = function()
  i = (i + 1) % 64
  return reqs[i]
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("allot-bench n %d errors %d\n", summary.requests, e.connect + e.read + e.write + e.status + e.timeout))
  for p = 1, 1000 do
    io.write(string.format("allot-bench p %d %d\n", p, latency:percentile(p / 10)))
  end
end
`

func newWrkLoad() (*wrkLoad, error) {
	bin, err := exec.LookPath("wrk")
	if err != nil {
		return nil, fmt.Errorf("-loadgen wrk: %w (apt-get install wrk)", err)
	}
	f, err := os.CreateTemp("", "allot-bench-*.lua")
	if err != nil {
		return nil, err
	}
	if _, err := f.WriteString(wrkScript); err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, err
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return nil, err
	}
	up, err := spawnLoad("")
	if err != nil {
		os.Remove(f.Name())
		return nil, err
	}
	return &wrkLoad{up: up, bin: bin, script: f.Name()}, nil
}

func (l *wrkLoad) upstream() string { return l.up.upstream() }

func (l *wrkLoad) close() {
	l.up.close()
	os.Remove(l.script)
}

func (l *wrkLoad) run(base string, d time.Duration, conc, rate int) (loadResult, error) {
	if rate > 0 {
		return loadResult{}, errors.New("-loadgen wrk is closed loop: -rate needs -loadgen process or inprocess")
	}
	secs := int64((d + time.Second - 1) / time.Second)
	threads := min(conc, 2)
	cmd := exec.Command(l.bin, "-t", strconv.Itoa(threads), "-c", strconv.Itoa(conc), "-d", fmt.Sprintf("%ds", secs),
		"--timeout", "10s", "-s", l.script, base+"/v1/search")
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	upCPU0, err := procCPU(l.up.cmd.Process.Pid)
	if err != nil {
		return loadResult{}, err
	}
	if err := cmd.Run(); err != nil {
		return loadResult{}, fmt.Errorf("wrk: %v: %s", err, strings.TrimSpace(stderr.String()))
	}
	upCPU1, err := procCPU(l.up.cmd.Process.Pid)
	if err != nil {
		return loadResult{}, err
	}
	res, err := parseWrk(out.Bytes())
	if err != nil {
		return loadResult{}, err
	}
	res.cpu = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime() + upCPU1 - upCPU0
	return res, nil
}

// parseWrk reads wrkScript's done() lines: the count, the errors and the
// 1000 latency percentiles (µs), from which it rebuilds a histogram of n
// values (each 0.1% of the requests at its percentile's latency).
func parseWrk(out []byte) (loadResult, error) {
	var res loadResult
	pct := make([]int64, 0, 1000)
	haveN := false
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || f[0] != "allot-bench" {
			continue
		}
		switch {
		case f[1] == "n" && len(f) == 5:
			n, err1 := strconv.ParseInt(f[2], 10, 64)
			e, err2 := strconv.ParseInt(f[4], 10, 64)
			if err1 != nil || err2 != nil || n < 0 || e < 0 || e > n {
				return res, fmt.Errorf("wrk: bad summary line %q", sc.Text())
			}
			res.n, res.errs, haveN = n, e, true
		case f[1] == "p" && len(f) == 4:
			us, err := strconv.ParseInt(f[3], 10, 64)
			if err != nil {
				return res, fmt.Errorf("wrk: bad percentile line %q", sc.Text())
			}
			pct = append(pct, us)
		}
	}
	if !haveN || len(pct) != 1000 {
		return res, fmt.Errorf("wrk: incomplete output (%d percentiles): %q", len(pct), out)
	}
	res.h = hdrhistogram.New(1, int64(10*time.Second/time.Nanosecond), 3)
	per := res.n / 1000
	for i, us := range pct {
		c := per
		if int64(i) < res.n%1000 {
			c++
		}
		if c > 0 {
			if err := res.h.RecordValues(max(us, 1)*int64(time.Microsecond), c); err != nil {
				return res, fmt.Errorf("wrk: %w", err)
			}
		}
	}
	res.n -= res.errs
	return res, nil
}

// procCPU is the user+system CPU time process pid has used.
func procCPU(pid int) (time.Duration, error) { return proccpu.Of(pid) }
