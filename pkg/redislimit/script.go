package redislimit

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// The script. One EVALSHA runs one operation on one key, atomically: Redis
// runs a script to completion with nothing interleaved, so read, refill,
// decide, write and TTL happen as one step.
//
// KEYS[1] is the key. ARGV: op, family, now (ms; < 0 = use Redis TIME), n,
// p1, p2, p3 (the family's parameters, below), slack (ms added to TTLs),
// shards and ttl (ms; for op promote: promoted until now + ttl). Op promote
// marks the key, or extends its promotion; op extend only extends a
// promotion, and on a key that is not promoted returns its state, changing
// nothing. Op drain is pkg/bucket's Drain.
//
// Lua numbers are doubles: every quantity below is an integer kept under
// 2⁵³ (see limitParams), integer division goes through idiv, which corrects
// the rounding of a/b, and numbers are written with %.0f (tostring would use
// %.14g and lose digits).
//
// Values are strings "kind:expires_at:...". expires_at (ms) is when the
// state means nothing any more (the bucket is full again, the window is
// over); the script treats a value past it as absent, so correctness never
// depends on the TTL, which is only cleanup, set slack after expires_at.
//
//	b:x:t:d:cost:rate   token bucket / GCRA: deficit d at time t, in units
//	                    where one token costs `cost` and `rate` units refill
//	                    per ms (tokens missing = d/cost)
//	f:x:start:count     fixed window
//	s:x:start:prev:curr sliding window
//	p:until:shards      the key is promoted to `shards` sub-keys until `until`
//
// Reply: {code, now, taken, v1, v2, v3}: code 1 allowed / done, 0 denied,
// 2 the key is promoted (v1 shards, v2 until), 3 the key was promoted by this
// call, 4 an existing promotion was extended (or is already longer); taken is the tokens op take
// took; v* is the state at now after the operation: bucket {d}, fixed
// {start, count}, sliding {start, prev, curr}.
const scriptSource = `
local OP_ALLOW, OP_TAKE, OP_GIVE, OP_DEBIT, OP_PEEK, OP_PROMOTE, OP_EXTEND, OP_DRAIN = 1, 2, 3, 4, 5, 6, 7, 8
local key = KEYS[1]
local op = tonumber(ARGV[1])
local fam = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local p1, p2, p3 = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local slack = tonumber(ARGV[8])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- floor(a/b) and a mod b, exact for integers a >= 0, b > 0 below 2^53
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then q = q - 1; r = r + b elseif r >= b then q = q + 1; r = r - b end
  return q, r
end
local function fmt(v) return string.format('%.0f', v) end

local f = {}
local raw = redis.call('GET', key)
if raw then for v in string.gmatch(raw, '[^:]+') do f[#f + 1] = v end end
local kind = f[1]
local x = tonumber(f[2]) or 0
-- A value this script did not write (or a corrupted one) counts as absent.
local need = ({b = 6, f = 4, s = 5, p = 3})[kind or '']
if need then
  for i = 2, need do if tonumber(f[i]) == nil then kind = nil end end
else
  kind = nil
end

local demoted = nil
if kind == 'p' then
  if x > now then
    if op ~= OP_PROMOTE and op ~= OP_EXTEND then return {2, now, 0, tonumber(f[3]), x} end
    local u = now + tonumber(ARGV[10])
    if u > x then
      redis.call('SET', key, 'p:' .. fmt(u) .. ':' .. f[3], 'PX', fmt(u - x + redis.call('PTTL', key)))
      x = u
    end
    return {4, now, 0, tonumber(f[3]), x}
  end
  -- The promotion ended at x: the key restarts empty at x (its budget was
  -- with the sub-keys), which can under-admit but never over-admit.
  demoted = x
  kind = nil
end

local code, taken, write, reply, refill = 1, 0, false, nil, 0

if fam == 1 then
  local cost, rate, burst = p1, p2, p3
  local cap = burst * cost
  local t, d = now, 0
  if kind == 'b' and x > now then
    t, d = tonumber(f[3]), tonumber(f[4])
    local oc, orate = tonumber(f[5]), tonumber(f[6])
    if oc ~= cost or orate ~= rate then
      -- the limit changed: carry the time to refill over, rounded up
      d = math.ceil(d * rate / orate)
      if d > 2 * cap then d = 2 * cap end
    end
  elseif demoted then
    t, d, write = demoted, cap, true
  end
  if now >= t then
    local r = (now - t) * rate
    if r >= d then d = 0 else d = d - r end
  else
    d = d + (t - now) * rate -- the clock went backwards: fewer tokens
  end
  if op == OP_ALLOW then
    if n > burst or d + n * cost > cap then code = 0
    elseif n > 0 then d = d + n * cost; write = true end
  elseif op == OP_TAKE then
    local q, r = idiv(d, cost)
    if r > 0 then q = q + 1 end
    local avail = burst - q
    if avail > 0 then
      if n < avail then avail = n end
      d = d + avail * cost; taken = avail; write = true
    end
  elseif op == OP_GIVE then
    if d > 0 then
      if d < 2 * cap and d < n * cost then d = 0 else d = d - n * cost end
      write = true
    end
  elseif op == OP_DEBIT then
    if d < 2 * cap then
      d = d + n * cost
      if d > 2 * cap then d = 2 * cap end
      write = true
    end
  elseif op == OP_DRAIN then
    if d < cap then d = cap; write = true end
  end
  if write then
    -- A full bucket is still written (it expires after slack): full at now
    -- is not full at an earlier instant, which a clock behind ours may ask.
    if d < 0 then d = 0 end
    local q, r = idiv(d, rate)
    if r > 0 then q = q + 1 end
    redis.call('SET', key, 'b:' .. fmt(now + q) .. ':' .. fmt(now) .. ':' .. fmt(d) .. ':' .. fmt(cost) .. ':' .. fmt(rate), 'PX', fmt(q + slack))
  end
  local q, r = idiv(cap, rate)
  refill = q + 1
  reply = {code, now, taken, d}
else
  local W, quota = p1, p2
  local _, m = idiv(now, W)
  local start, eff = now - m, now
  local prev, curr = 0, 0
  local function load(s, p, c)
    if s == start then prev, curr = p, c
    elseif start < s then eff, start, prev, curr = s, s, p, c
    elseif fam == 3 and start - s == W then prev = c end
  end
  if fam == 2 and kind == 'f' then load(tonumber(f[3]), 0, tonumber(f[4]))
  elseif fam == 3 and kind == 's' then load(tonumber(f[3]), tonumber(f[4]), tonumber(f[5]))
  elseif demoted then
    local _, dm = idiv(demoted, W)
    load(demoted - dm, 0, quota)
    write = true
  end
  if curr < 0 then curr = 0 end
  local cap = quota * W
  -- est: tokens taken, in units of 1/W token (the sliding-window estimate;
  -- for the fixed window prev is 0 and this is count*W)
  local est = prev * (W - (eff - start)) + curr * W
  local function remaining(e)
    if e <= cap then local q = idiv(cap - e, W); return q end
    if e >= 2 * cap then return -quota end
    local q, r = idiv(e - cap, W)
    if r > 0 then q = q + 1 end
    return -q
  end
  if op == OP_ALLOW then
    if n > quota or cap < est + n * W then code = 0
    elseif n > 0 then curr = curr + n; write = true end
  elseif op == OP_TAKE then
    local g = remaining(est)
    if n < g then g = n end
    if g > 0 then curr = curr + g; taken = g; write = true end
  elseif op == OP_GIVE then
    local c = n
    if curr < c then c = curr end
    curr = curr - c
    local p = n - c
    if prev < p then p = prev end
    prev = prev - p
    write = true
  elseif op == OP_DEBIT then
    if fam == 2 then
      if curr < 2 * quota then
        curr = curr + n
        if curr > 2 * quota then curr = 2 * quota end
        write = true
      end
    elseif est < 2 * cap then
      local room = idiv(2 * cap - est, W)
      if n < room then room = n end
      curr = curr + room
      write = true
    end
  elseif op == OP_DRAIN then
    if curr < quota then curr = quota; write = true end
  end
  if write then
    -- Empty windows are written too: they pin the window for a clock behind.
    local xe = start + W
    if fam == 3 and curr > 0 then xe = xe + W end
    if fam == 2 then
      redis.call('SET', key, 'f:' .. fmt(xe) .. ':' .. fmt(start) .. ':' .. fmt(curr), 'PX', fmt(xe - now + slack))
    else
      redis.call('SET', key, 's:' .. fmt(xe) .. ':' .. fmt(start) .. ':' .. fmt(prev) .. ':' .. fmt(curr), 'PX', fmt(xe - now + slack))
    end
  end
  refill = 2 * W
  if fam == 2 then reply = {code, now, taken, start, curr} else reply = {code, now, taken, start, prev, curr} end
end

if op == OP_PROMOTE then
  -- Mark the key promoted; its TTL outlives the promotion by a full refill,
  -- so that the state it restarts from (empty at until) is what a reader
  -- finds until that state would be full anyway.
  local u = now + tonumber(ARGV[10])
  redis.call('SET', key, 'p:' .. fmt(u) .. ':' .. fmt(tonumber(ARGV[9])), 'PX', fmt(u - now + refill + slack))
  reply[1] = 3
end
return reply
`

// Script operations (ARGV[1]).
type op uint8

const (
	opAllow op = iota + 1
	opTake
	opGive
	opDebit
	opPeek
	opPromote
	opExtend
	opDrain // Limit.Drain
)

// Script families (ARGV[2]).
const (
	famBucket  = 1 // TokenBucket and GCRA: they share pkg/bucket's State encoding and results
	famFixed   = 2
	famSliding = 3
)

// Reply codes.
const (
	codeDenied   = 0
	codeOK       = 1
	codePromoted = 2 // the key is promoted; the call did nothing
	codeMarked   = 3 // op promote marked the key
	codeExtended = 4 // op promote or extend found the key promoted and extended the promotion
)

// ErrUnsupportedLimit is wrapped by the error for a limit the script cannot
// compute exactly: a window that is not a whole number of milliseconds for
// the window algorithms, or parameters whose integers would reach 2⁵³.
var ErrUnsupportedLimit = errors.New("redislimit: limit not supported by the Redis backend")

// maxExact bounds the integers the script handles (2⁵³, where doubles stop
// being exact).
const maxExact = 1 << 53

// params is a Limit translated into the script's integer parameters.
type params struct {
	fam        int
	p1, p2, p3 int64
	// unit (famBucket): a deficit of d script units is d·unit/quota ns of
	// refill, i.e. pkg/bucket's deficit D = d·unit.
	unit uint64
}

const nsPerMs = int64(time.Millisecond)

func gcd(a, b uint64) uint64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// limitParams translates l for the script.
//
// Token bucket and GCRA: with window w (ns) and quota q, a token costs w and
// one ms refills 10⁶·q in pkg/bucket's deficit units; both are divided by
// g = gcd(w, 10⁶·q) to give the script's cost and rate, and capacity is
// burst·cost. The script's deficit d is then pkg/bucket's deficit divided by
// g, exactly, at every whole-millisecond instant. Rejected if rate or
// 4·capacity reach 2⁵³ (4: the debt floor is 2·capacity, a take adds up to
// one more).
//
// Windows: W = w in ms (w must be a whole number of ms), and 4·q·W < 2⁵³.
func limitParams(l bucket.Limit) (params, error) {
	w, q, burst := uint64(l.Window()), uint64(l.Quota()), uint64(l.Burst())
	fail := func(format string, args ...any) (params, error) {
		return params{}, fmt.Errorf("%w: %v: "+format, append([]any{ErrUnsupportedLimit, l}, args...)...)
	}
	switch l.Algorithm() {
	case bucket.TokenBucket, bucket.GCRA:
		g1 := gcd(w, uint64(nsPerMs))
		g2 := gcd(w/g1, q) // gcd(w, 10⁶·q) = g1·gcd(w/g1, q)
		cost := w / g1 / g2
		hi, rate := bits.Mul64(uint64(nsPerMs)/g1, q/g2)
		if hi != 0 || rate >= maxExact {
			return fail("refill per ms %d·%d is not exact in a double", uint64(nsPerMs)/g1, q/g2)
		}
		hi, capacity := bits.Mul64(burst, cost)
		if hi != 0 || capacity >= maxExact/4 {
			return fail("burst·cost %d·%d is not exact in a double", burst, cost)
		}
		return params{fam: famBucket, p1: int64(cost), p2: int64(rate), p3: int64(burst), unit: g1 * g2}, nil
	default:
		if w%uint64(nsPerMs) != 0 {
			return fail("window must be a whole number of milliseconds")
		}
		wms := w / uint64(nsPerMs)
		hi, c := bits.Mul64(q, wms)
		if hi != 0 || c >= maxExact/4 {
			return fail("quota·window(ms) %d·%d is not exact in a double", q, wms)
		}
		fam := famFixed
		if l.Algorithm() == bucket.SlidingWindow {
			fam = famSliding
		}
		return params{fam: fam, p1: int64(wms), p2: int64(q)}, nil
	}
}

// stateFrom converts the script's state reply (v, after code and now) into
// pkg/bucket's State for l.
func (p *params) stateFrom(l bucket.Limit, nowNs int64, v []int64) (bucket.State, error) {
	switch p.fam {
	case famBucket:
		if len(v) < 1 {
			return bucket.State{}, errShortReply
		}
		d := v[0]
		if d <= 0 {
			return bucket.State{}, nil // full
		}
		hi, lo := bits.Mul64(uint64(d), p.unit)
		q := uint64(l.Quota())
		if hi >= q {
			return bucket.State{A: math.MaxInt64}, nil // absurdly far ahead: empty
		}
		off, frac := bits.Div64(hi, lo, q)
		if off > uint64(math.MaxInt64-nowNs) {
			return bucket.State{A: math.MaxInt64}, nil
		}
		return bucket.State{A: nowNs + int64(off), B: int64(frac)}, nil
	case famFixed:
		if len(v) < 2 {
			return bucket.State{}, errShortReply
		}
		return bucket.State{A: v[0] * nsPerMs, B: v[1]}, nil
	default:
		if len(v) < 3 {
			return bucket.State{}, errShortReply
		}
		prev, curr := uint64(max(v[1], 0)), uint64(max(v[2], 0))
		return bucket.State{A: v[0] * nsPerMs, B: int64(prev<<32 | curr&math.MaxUint32)}, nil
	}
}

var errShortReply = errors.New("redislimit: malformed script reply")

// resultFrom computes the Result of AllowN(n) from the script's decision and
// the state after it, with pkg/bucket's own arithmetic: allowed → Peek of the
// new state (Remaining = before − n, ResetAfter), denied → AllowN on a copy
// of the unchanged state (RetryAfter for n).
func resultFrom(l bucket.Limit, allowed bool, st bucket.State, nowNs, n int64) bucket.Result {
	if allowed {
		r := l.Peek(st, nowNs)
		r.Allowed, r.RetryAfter = true, 0
		return r
	}
	r := l.AllowN(&st, nowNs, n)
	if r.Allowed || r.RetryAfter <= 0 {
		// Unreachable while the script and pkg/bucket agree (the tests
		// hold them to it); a denial always says when to come back.
		r.Allowed, r.RetryAfter = false, time.Millisecond
	}
	return r
}
