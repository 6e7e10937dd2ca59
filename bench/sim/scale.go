package main

import "time"

// scale sizes every scenario. full is the reference sizing; quick is
// `make sim`; tiny is what the tests run.
type scale struct {
	name   string
	agents int // gateways with an agent (N)

	// The fleet run: Zipf(1.1) over keys, a base rate with one peak.
	keys             int
	base, peak       float64 // requests/s
	peakFrom, peakTo time.Duration
	fleet            time.Duration // measured time after the warm-up
	warmup           time.Duration
	groups           int // allocator Raft groups the fleet runs on
	nodes            int // allocator nodes the groups' leaders spread over (0: 3)
	sample           int // groups whose keys are simulated (0: all; see sampleGroups)

	// The 10× fleet: ten times the fleet's agents, keys and rates, on
	// groups10 groups led by nodes10 nodes, of which sample10 groups are
	// simulated (0: all), measured
	// for fleet10, its peak (if peak10 > 0) peak10 long from peak10From
	// after the warm-up.
	groups10, sample10 int
	nodes10            int // allocator nodes of the 10× fleet (0: 3)
	fleet10            time.Duration
	peak10From, peak10 time.Duration

	chaos     time.Duration // measured time of the chaos scenarios
	hotRate   float64       // the hot key's offered rate
	hotAgents int           // gateways the hot key is spread over (the coordination target is at 200)
	clients   int           // retry storm clients

	// The regions run: 3 regions of regionGateways gateways each, one
	// global key of regionRate/s.
	regionGateways int
	regionRate     int64
}

var scales = map[string]scale{
	"tiny": {
		name: "tiny", agents: 4,
		keys: 2000, base: 2000, peak: 2000, fleet: 4 * time.Second, warmup: time.Second, groups: 1,
		groups10: 2, fleet10: time.Second,
		chaos: 12 * time.Second, hotRate: 6000, hotAgents: 4, clients: 300,
		regionGateways: 3, regionRate: 1200,
	},
	"quick": {
		name: "quick", agents: 20,
		keys: 100_000, base: 100_000, peak: 100_000, fleet: 20 * time.Second, warmup: 5 * time.Second, groups: 1,
		groups10: 4, fleet10: 5 * time.Second,
		chaos: 25 * time.Second, hotRate: 120_000, hotAgents: 200, clients: 2000,
		regionGateways: 20, regionRate: 6000,
	},
	"full": {
		name: "full", agents: 200,
		keys: 5_000_000, base: 300_000, peak: 1_000_000, peakFrom: 25 * time.Second, peakTo: 35 * time.Second,
		fleet: 55 * time.Second, warmup: 5 * time.Second, groups: 4,
		groups10: 128, sample10: 2, fleet10: 10 * time.Second, peak10From: 5 * time.Second, peak10: 5 * time.Second,
		chaos: 30 * time.Second, hotRate: 150_000, hotAgents: 200, clients: 20_000,
		regionGateways: 67, regionRate: 20_000,
	},
}
