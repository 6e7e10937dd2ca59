//go:build !linux

package allocator

import "errors"

func lowerThreadPriority(int) error {
	return errors.New("a thread's own priority is set on Linux only")
}

func onMainThread() bool { return false }

func threadNice() (int, error) {
	return 0, errors.New("a thread's own priority is read on Linux only")
}
