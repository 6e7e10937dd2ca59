package cpuburn

import (
	"testing"

	"go.uber.org/goleak"
)

func TestStartStop(t *testing.T) {
	defer goleak.VerifyNone(t)
	b := Start(2)
	b.Stop()
	b.Stop() // twice is safe
	Start(0).Stop()
}
