//go:build !linux

package main

import "os/exec"

// killWithParent does nothing here: stop (and the run's interrupt
// handler) kill the burners.
func killWithParent(*exec.Cmd) {}
