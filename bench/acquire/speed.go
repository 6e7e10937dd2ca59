package main

import (
	"fmt"
	"slices"
	"time"

	"github.com/allot/allot/internal/proccpu"
)

// speedProbe samples the machine's speed (proccpu.Speed: a fixed piece of
// work per CPU-millisecond) over the measured window, on the load
// client's own thread: 10 ms of CPU every 500 ms. Its CPU is taken out of
// the load client's in the report.
type speedProbe struct {
	done   chan struct{}
	speeds []float64
	cpu    time.Duration
	err    error
}

const (
	speedEvery = 500 * time.Millisecond
	speedCPU   = 10 * time.Millisecond
)

// startSpeedProbe samples until end; report waits for it.
func startSpeedProbe(end time.Time) *speedProbe {
	p := &speedProbe{done: make(chan struct{})}
	go func() { // ends by end; report waits for it
		defer close(p.done)
		for time.Now().Before(end) {
			s, used, err := proccpu.Speed(speedCPU)
			if err != nil {
				p.err = err
				return
			}
			p.cpu += used
			p.speeds = append(p.speeds, s)
			time.Sleep(min(speedEvery, time.Until(end)))
		}
	}()
	return p
}

// wait returns the probe's CPU (its thread's, taken out of the load
// client's CPU) once it has ended.
func (p *speedProbe) wait() time.Duration {
	<-p.done
	return p.cpu
}

// report prints the speed's median and range, and the allocators' CPU
// against the load client's: the client does the same work for each
// call whatever the allocators do, so that ratio moves with the code and
// not with the machine's speed.
func (p *speedProbe) report(allocators, client time.Duration) {
	<-p.done
	if p.err != nil {
		fmt.Printf("machine speed: %v\n", p.err)
		return
	}
	if len(p.speeds) == 0 {
		return
	}
	s := slices.Clone(p.speeds)
	slices.Sort(s)
	ratio := "n/a"
	if client > 0 {
		ratio = fmt.Sprintf("%.2f", allocators.Seconds()/client.Seconds())
	}
	fmt.Printf("machine speed (internal/proccpu.Speed, %v of fixed work every %v on the load client): median %.1f units per CPU-ms (%.1f–%.1f), n=%d; the allocators' CPU against the load client's: %s\n",
		speedCPU, speedEvery, s[len(s)/2], s[0], s[len(s)-1], len(s), ratio)
}
