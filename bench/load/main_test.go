package main

import (
	"flag"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/pkg/rules"
)

func TestParseFlagsRedisModes(t *testing.T) {
	parse := func(args ...string) (options, error) {
		fs := flag.NewFlagSet("load", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		return parseFlags(fs, args)
	}
	for i, tc := range []struct {
		args   []string
		modes  []redisMode
		shards int
		dur    time.Duration
	}{
		// The default keeps existing commands' meaning: the EVAL baseline only.
		{nil, []redisMode{modeEval}, 4, 0},
		{[]string{"-redis-modes", "eval,sharded,batched"}, []redisMode{modeEval, modeSharded, modeBatched}, 4, 0},
		{[]string{"-redis-modes", "batched, eval", "-redis-shards", "8"}, []redisMode{modeBatched, modeEval}, 8, 0},
		{[]string{"-redis-modes", "sharded-batched", "-redis-duration", "2s"}, []redisMode{modeShardedBatched}, 4, 2 * time.Second},
		{[]string{"-workload", "longtail", "-redis-modes", "sharded"}, []redisMode{modeSharded}, 4, 0},
	} {
		o, err := parse(tc.args...)
		if err != nil {
			t.Errorf("case %d: parseFlags(%q): %v", i, tc.args, err)
			continue
		}
		if !slices.Equal(o.redisModes, tc.modes) || o.redisShards != tc.shards || o.redisDuration != tc.dur {
			t.Errorf("case %d: parseFlags(%q) = modes %v shards %d duration %v, want %v %d %v",
				i, tc.args, o.redisModes, o.redisShards, o.redisDuration, tc.modes, tc.shards, tc.dur)
		}
	}
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"-redis-modes", ""}, "unknown mode"},
		{[]string{"-redis-modes", "eval,"}, "unknown mode"},
		{[]string{"-redis-modes", "lua"}, "unknown mode"},
		{[]string{"-redis-modes", "eval,sharded,eval"}, "given twice"},
		{[]string{"-redis-shards", "1"}, "-redis-shards"},
		{[]string{"-redis-shards", "2000"}, "-redis-shards"},
		{[]string{"-redis-duration", "10ms"}, "-redis-duration"},
	} {
		_, err := parse(tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("parseFlags(%q) = %v, want an error containing %q", tc.args, err, tc.msg)
		}
	}
}

func TestRedisModeNames(t *testing.T) {
	for _, tc := range []struct {
		m                redisMode
		backend          string
		sharded, batched bool
	}{
		{modeEval, "redis", false, false},
		{modeSharded, "redis-sharded", true, false},
		{modeBatched, "redis-batched", false, true},
		{modeShardedBatched, "redis-sharded-batched", true, true},
	} {
		if tc.m.backend() != tc.backend || tc.m.sharded() != tc.sharded || tc.m.batched() != tc.batched {
			t.Errorf("%s: backend %q sharded %v batched %v, want %q %v %v",
				tc.m, tc.m.backend(), tc.m.sharded(), tc.m.batched(), tc.backend, tc.sharded, tc.batched)
		}
	}
}

func TestRulesYAMLShards(t *testing.T) {
	for _, shards := range []int{0, 4} {
		set, err := rules.Compile(1, []rules.File{{Name: "load.yaml", Source: rulesYAML(100, 50, "redis", shards)}})
		if err != nil {
			t.Fatalf("shards %d: %v", shards, err)
		}
		want := max(shards, 1)
		r := set.Match(domain, []rules.Entry{{Key: "user", Value: "u1"}})
		if r == nil || r.Shards != want || r.Backend != rules.BackendRedis || r.Limit.Quota() != 100 || r.Limit.Burst() != 50 {
			t.Errorf("shards %d: user rule %+v, want redis 100/s burst 50 shards %d", shards, r, want)
		}
		if p := set.Match(domain, []rules.Entry{{Key: "probe", Value: "p"}}); p == nil || p.Shards > 1 {
			t.Errorf("shards %d: probe rule %+v, want unsharded", shards, p)
		}
	}
}
