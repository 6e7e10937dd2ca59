package main

// traffic is one group's keys and their load in a small scenario: keys keys,
// each offered demand requests/s, routed by route.
type traffic struct {
	g      *group
	keys   int
	demand float64
	route  router // nil: spread uniformly
	first  int    // index of the group's first key (set by layout)
}

// layout numbers the keys of every group consecutively.
func layout(ts []*traffic) (groups []*group, groupOf func(int) int, keys int) {
	owner := []int{}
	for i, t := range ts {
		t.first = keys
		keys += t.keys
		groups = append(groups, t.g)
		for range t.keys {
			owner = append(owner, i)
		}
	}
	return groups, func(k int) int { return owner[k] }, keys
}

// startTraffic starts one Poisson source per group.
func startTraffic(w *world, seed uint64, ts []*traffic) []*arrivals {
	var out []*arrivals
	for _, t := range ts {
		rng := newRand(seed, "traffic-"+t.g.name)
		route := t.route
		if route == nil {
			route = &spread{rng: newRand(seed, "route-"+t.g.name), n: w.cfg.agents}
		}
		a := &arrivals{w: w, rng: rng, rate: constant(t.demand * float64(t.keys)), route: route,
			key: func() int { return t.first + rng.IntN(t.keys) }}
		a.start()
		out = append(out, a)
	}
	return out
}

// keysOf lists a group's key indices.
func (t *traffic) keysOf() []int {
	out := make([]int, t.keys)
	for i := range out {
		out[i] = t.first + i
	}
	return out
}
