package allocator

import "golang.org/x/sys/unix"

// lowerThreadPriority sets the calling thread's nice value (Linux: a
// thread's own, not the process's).
func lowerThreadPriority(nice int) error {
	return unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), nice)
}

// onMainThread reports whether the calling thread is the process's main
// thread.
func onMainThread() bool { return unix.Gettid() == unix.Getpid() }

// threadNice returns the calling thread's nice value.
func threadNice() (int, error) {
	// The raw getpriority answers 20 − nice (1..40).
	p, err := unix.Getpriority(unix.PRIO_PROCESS, unix.Gettid())
	return 20 - p, err
}
