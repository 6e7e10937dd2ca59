package allocproc

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

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

// CPUTime returns a process's user+system CPU time so far, from
// /proc/<pid>/stat (0 if it cannot be read), in units of USER_HZ (10 ms).
func CPUTime(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command name (which may hold spaces and
	// parentheses) start with state, field 3; utime is 14, stime 15.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * time.Second / userHZ
}

// userHZ is the unit of /proc/<pid>/stat's times (100 on every Linux
// architecture Go supports).
const userHZ = 100
