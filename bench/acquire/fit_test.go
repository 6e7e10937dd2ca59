package main

import (
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
)

// cpuFitRuns is the raw output the simulator's CPU model is fitted to
// (bench/sim measuredCPU; docs/performance.md, the row "CPU per Raft entry
// and per key-grant").
const cpuFitRuns = "results/simfit-6ae8f1e-*.txt"

var (
	fitEntries = regexp.MustCompile(`(?m)^raft: (\d+) acquire entries/s`)
	fitLeader  = regexp.MustCompile(`\(leader\) ([0-9.]+) cores`)
	fitSummed  = regexp.MustCompile(`allocators ([0-9.]+) cores, ([0-9.]+) µs/key-grant`)
)

// fitRun is one run: Acquire entries/s, key-grants/s (keys answered OK),
// and the cores of the leader and of the three allocators.
type fitRun struct {
	file                  string
	entries, keys         float64
	leaderCores, allCores float64
}

func parseFitRun(path string) (fitRun, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return fitRun{}, err
	}
	r := fitRun{file: filepath.Base(path)}
	e, l, s := fitEntries.FindSubmatch(b), fitLeader.FindSubmatch(b), fitSummed.FindSubmatch(b)
	if e == nil || l == nil || s == nil {
		return r, os.ErrNotExist
	}
	r.entries, _ = strconv.ParseFloat(string(e[1]), 64)
	r.leaderCores, _ = strconv.ParseFloat(string(l[1]), 64)
	r.allCores, _ = strconv.ParseFloat(string(s[1]), 64)
	perKey, _ := strconv.ParseFloat(string(s[2]), 64)
	if perKey <= 0 {
		return r, os.ErrNotExist
	}
	r.keys = r.allCores / (perKey * 1e-6)
	return r, nil
}

// fitThroughOrigin fits y = a·x1 + b·x2 by least squares and returns a, b
// and R² (about y's mean).
func fitThroughOrigin(x1, x2, y []float64) (a, b, r2 float64) {
	var s11, s12, s22, s1y, s2y, mean float64
	for i := range y {
		s11 += x1[i] * x1[i]
		s12 += x1[i] * x2[i]
		s22 += x2[i] * x2[i]
		s1y += x1[i] * y[i]
		s2y += x2[i] * y[i]
		mean += y[i] / float64(len(y))
	}
	det := s11*s22 - s12*s12
	a = (s1y*s22 - s2y*s12) / det
	b = (s2y*s11 - s1y*s12) / det
	var res, tot float64
	for i := range y {
		d := y[i] - a*x1[i] - b*x2[i]
		res += d * d
		tot += (y[i] - mean) * (y[i] - mean)
	}
	return a, b, 1 - res/tot
}

func TestFitThroughOrigin(t *testing.T) {
	x1 := []float64{1, 2, 3, 4}
	x2 := []float64{10, 5, 40, 20}
	y := make([]float64, len(x1))
	for i := range y {
		y[i] = 2*x1[i] + 0.5*x2[i]
	}
	a, b, r2 := fitThroughOrigin(x1, x2, y)
	if math.Abs(a-2) > 1e-9 || math.Abs(b-0.5) > 1e-9 || math.Abs(r2-1) > 1e-9 {
		t.Fatalf("fit of an exact line: a %g, b %g, R² %g; want 2, 0.5, 1", a, b, r2)
	}
}

// TestCPUFit prints the fit of the allocators' cores on Acquire entries/s
// and key-grants/s over the runs in cpuFitRuns, summed over the three
// nodes and for the leader: go test -run TestCPUFit -v ./bench/acquire/
func TestCPUFit(t *testing.T) {
	paths, err := filepath.Glob(cpuFitRuns)
	if err != nil {
		t.Fatal(err)
	}
	var runs []fitRun
	for _, p := range paths {
		r, err := parseFitRun(p)
		if err != nil {
			t.Logf("%s: no entries or CPU line, left out", filepath.Base(p))
			continue
		}
		runs = append(runs, r)
	}
	if len(runs) < 3 {
		t.Fatalf("%d usable runs in %s, want at least 3", len(runs), cpuFitRuns)
	}
	var entries, keys, all, leader []float64
	var sumAll, sumLeader float64
	for _, r := range runs {
		entries, keys = append(entries, r.entries), append(keys, r.keys)
		all, leader = append(all, r.allCores), append(leader, r.leaderCores)
		sumAll += r.allCores
		sumLeader += r.leaderCores
		t.Logf("%-40s %4.0f entries/s %7.0f key-grants/s  leader %.3f  allocators %.3f cores", r.file, r.entries, r.keys, r.leaderCores, r.allCores)
	}
	a, b, r2 := fitThroughOrigin(entries, keys, all)
	t.Logf("summed over the three nodes: %.3f ms per entry + %.2f µs per key-grant, R² %.3f, n=%d", a*1e3, b*1e6, r2, len(runs))
	la, lb, lr2 := fitThroughOrigin(entries, keys, leader)
	t.Logf("leader: %.3f ms per entry + %.2f µs per key-grant, R² %.3f", la*1e3, lb*1e6, lr2)
	t.Logf("leader's share of the three nodes' cores over the runs: %.3f", sumLeader/sumAll)
	if a <= 0 || b <= 0 {
		t.Errorf("the fit's costs must be positive: %g s per entry, %g s per key-grant", a, b)
	}
}
