// Package proccpu reads processes' CPU time (user + system), for benchmarks
// that report CPU per operation: on a machine shared with other work,
// wall-clock figures include the time spent waiting for a core, while CPU
// time barely moves with the load. Linux only.
package proccpu

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Self is the CPU time this process has used, from getrusage (nanosecond
// resolution).
func Self() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, err
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}

// Thread is the CPU time the calling OS thread has used, from getrusage
// (RUSAGE_THREAD). Call it from a goroutine locked to its thread
// (runtime.LockOSThread), or the figure mixes threads.
func Thread() (time.Duration, error) {
	const rusageThread = 1 // RUSAGE_THREAD (Linux)
	var ru syscall.Rusage
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		return 0, err
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}

// Of is the CPU time process pid has used, from /proc/<pid>/stat (in clock
// ticks of 10 ms); pid 0 means this process.
func Of(pid int) (time.Duration, error) {
	path := "/proc/self/stat"
	if pid != 0 {
		path = fmt.Sprintf("/proc/%d/stat", pid)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces: fields count from the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("%s: unexpected format", path)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("%s: unexpected format", path)
	}
	const tick = time.Second / 100              // USER_HZ
	ut, err1 := strconv.ParseInt(f[11], 10, 64) // field 14, utime
	st, err2 := strconv.ParseInt(f[12], 10, 64) // field 15, stime
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("%s: unexpected format", path)
	}
	return time.Duration(ut+st) * tick, nil
}

// LoadAvg is the first three fields of /proc/loadavg ("?" elsewhere): the
// machine is shared, so every figure carries the load it was measured under.
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// Sched is the time process pid's threads (pid 0: this process) have spent
// on a core and waiting on a run queue for one, summed over the threads
// alive now (/proc/<pid>/task/*/schedstat, nanoseconds). On a shared
// machine the wait is the part of a goroutine's wall time that Go's own
// trace shows as running: the thread is runnable, but the kernel has not
// given it a core.
func Sched(pid int) (run, wait time.Duration, err error) {
	dir := "/proc/self/task"
	if pid != 0 {
		dir = fmt.Sprintf("/proc/%d/task", pid)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, 0, err
	}
	for _, e := range ents {
		b, err := os.ReadFile(dir + "/" + e.Name() + "/schedstat")
		if err != nil {
			continue // the thread has exited
		}
		f := strings.Fields(string(b))
		if len(f) < 2 {
			return 0, 0, fmt.Errorf("%s/%s/schedstat: unexpected format", dir, e.Name())
		}
		r, err1 := strconv.ParseInt(f[0], 10, 64)
		w, err2 := strconv.ParseInt(f[1], 10, 64)
		if err1 != nil || err2 != nil {
			return 0, 0, fmt.Errorf("%s/%s/schedstat: unexpected format", dir, e.Name())
		}
		run += time.Duration(r)
		wait += time.Duration(w)
	}
	return run, wait, nil
}

// Machine is the machine's CPU time by kind, from the first line of
// /proc/stat (clock ticks, summed over the cores).
type Machine struct {
	Idle, IOWait, Steal, Total int64
}

// ReadMachine reads /proc/stat.
func ReadMachine() (Machine, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return Machine{}, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return Machine{}, fmt.Errorf("/proc/stat: unexpected format")
	}
	var m Machine
	for i, s := range f[1:] {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return Machine{}, fmt.Errorf("/proc/stat: unexpected format")
		}
		if i < 8 { // user nice system idle iowait irq softirq steal; guest is within user
			m.Total += v
		}
		switch i {
		case 3:
			m.Idle = v
		case 4:
			m.IOWait = v
		case 7:
			m.Steal = v
		}
	}
	return m, nil
}

// Share returns what part of the time between m0 and m1 was idle, iowait
// and steal.
func Share(m0, m1 Machine) (idle, iowait, steal float64) {
	t := float64(m1.Total - m0.Total)
	if t <= 0 {
		return 0, 0, 0
	}
	return float64(m1.Idle-m0.Idle) / t, float64(m1.IOWait-m0.IOWait) / t, float64(m1.Steal-m0.Steal) / t
}
