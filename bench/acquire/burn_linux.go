package main

import (
	"os/exec"
	"syscall"
)

// killWithParent has cmd's process killed when this one exits.
func killWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
