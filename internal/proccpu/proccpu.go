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
