package allocator

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// batcher sits in front of raft.Apply for Acquire. Calls queue up while a
// batch commits; the next batch drains everything queued (up to maxKeys
// keys and maxBytes bytes) into one entry stamped with the leader's clock,
// so the commit cost (two fsyncs) is paid once per batch. At most
// maxInflight batches are in Raft at once.
//
// With linger set, a batch is proposed no sooner than linger after the
// one before it: calls that arrive close together share an entry (whose
// append, fsyncs, replication and apply are paid per entry on every
// node), while a call that comes after a pause of linger or more goes at
// once. A call waits at most linger beyond what it waited before.
//
// With fillKeys and fillWait set, a batch short of fillKeys keys also
// waits for more calls, but only when the key rate of the last moments
// (an exponentially decayed count of submitted keys) says they will come
// before its first call has been queued fillWait: under a high key rate,
// calls that would each pay an entry share one, while at a lower rate,
// or with calls large enough on their own, nothing waits. A call waits at
// most fillWait for it.
//
// The entry is a compact Acquire entry (state.AppendAcquireEntry): each
// call's record is encoded by the caller's goroutine in submit, and the
// batch joins them. With legacy set it is an AcquireBatch Command instead,
// which every version of the allocator applies (a rolling upgrade from a
// version without compact entries runs legacy until every node is new).
type batcher struct {
	// propose commits one encoded entry and returns the FSM's result.
	propose func(data []byte) (any, error)
	// now stamps a batch (Unix nanoseconds, non-decreasing).
	now func() int64
	// legacy: propose AcquireBatch Commands, not compact entries.
	legacy bool
	// linger: the least time between two proposals (0: none).
	linger time.Duration
	// last is when the loop last proposed a batch (the loop's own).
	last time.Time
	// fillKeys and fillWait: a batch short of fillKeys keys waits up to
	// fillWait after its first call was queued for calls that the recent
	// key rate says will fill it (0: never).
	fillKeys int
	fillWait time.Duration
	// observe, when set, sees each committed batch: its calls and keys
	// (metrics).
	observe func(calls, keys int)
	// queued, when set, is told how long each call waited in the queue
	// before its batch was proposed (metrics).
	queued func(time.Duration)

	maxKeys, maxBytes int
	// maxQueue caps the calls waiting in queue (0: no cap); submit refuses
	// the excess at once with errOverloaded.
	maxQueue int
	slots    chan struct{} // one token per batch in flight

	mu     sync.Mutex // guards queue, qkeys, rate and closed
	queue  []*pendingAcquire
	qkeys  int // keys of the calls in queue
	rate   keyRate
	closed bool

	wake chan struct{} // capacity 1: the queue became non-empty
	stop chan struct{} // closed by close
	wg   sync.WaitGroup
}

type pendingAcquire struct {
	ctx   context.Context
	req   *allotv1.AcquireRequest
	rec   []byte // its compact record (nil when legacy)
	keys  int
	bytes int
	done  chan acquireResult // capacity 1
	at    time.Time          // when submit queued it
}

type acquireResult struct {
	resp *allotv1.AcquireResponse
	err  error
}

func newBatcher(propose func([]byte) (any, error), now func() int64, maxKeys, maxBytes, maxInflight int) *batcher {
	return &batcher{
		propose:  propose,
		now:      now,
		maxKeys:  maxKeys,
		maxBytes: maxBytes,
		slots:    make(chan struct{}, maxInflight),
		wake:     make(chan struct{}, 1),
		stop:     make(chan struct{}),
	}
}

// start runs the batching loop; close stops it.
func (b *batcher) start() {
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		b.loop()
	}()
}

// submit queues req and waits for its result. If ctx ends first the call
// returns ctx's error; the request may still be applied, which is safe:
// Acquire is idempotent per (agent_id, request_id).
func (b *batcher) submit(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	p := &pendingAcquire{
		ctx:  ctx,
		req:  req,
		keys: req.KeyCount(),
		done: make(chan acquireResult, 1),
	}
	if b.legacy {
		p.bytes = proto.Size(req)
	} else {
		p.rec = state.AppendAcquireRecord(nil, req)
		p.bytes = len(p.rec)
	}
	p.at = time.Now()
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, errShutdown
	}
	if b.maxQueue > 0 && len(b.queue) >= b.maxQueue {
		b.mu.Unlock()
		return nil, errOverloaded
	}
	b.queue = append(b.queue, p)
	b.qkeys += p.keys
	b.rate.add(p.at, p.keys)
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default:
	}
	select {
	case r := <-p.done:
		return r.resp, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (b *batcher) loop() {
	for {
		select {
		case <-b.stop:
			return
		case <-b.wake:
		}
		for {
			// Wait for a free slot before draining, so that everything
			// that arrives while the previous batch commits joins the next.
			select {
			case b.slots <- struct{}{}:
			case <-b.stop:
				return
			}
			if !b.lingerWait() || !b.fill() {
				<-b.slots
				return
			}
			batch := b.take()
			if len(batch) == 0 {
				<-b.slots
				break
			}
			if b.linger > 0 {
				b.last = time.Now()
			}
			if cap(b.slots) == 1 {
				b.commit(batch)
				<-b.slots
				continue
			}
			b.wg.Add(1)
			go func() {
				defer b.wg.Done()
				defer func() { <-b.slots }()
				b.commit(batch)
			}()
		}
	}
}

// lingerWait waits until linger has passed since the last proposal. It
// reports false if the batcher closed meanwhile.
func (b *batcher) lingerWait() bool {
	if b.linger <= 0 {
		return true
	}
	d := b.linger - time.Since(b.last)
	if d <= 0 {
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-b.stop:
		return false
	}
}

// keyRateTau is the time constant of the batcher's key rate: the rate
// follows a change in load within a few tenths of a second.
const keyRateTau = 100 * time.Millisecond

// keyRate is an exponentially decayed count of keys: each key counts
// e^(-age/keyRateTau), so the sum over keyRateTau is the recent rate.
type keyRate struct {
	sum  float64
	last time.Time
}

// add counts keys submitted at now (a caller's clock read before the
// lock may run a little behind the last one's).
func (r *keyRate) add(now time.Time, keys int) {
	r.sum = r.decayed(now) + float64(keys)
	if now.After(r.last) {
		r.last = now
	}
}

func (r *keyRate) decayed(now time.Time) float64 {
	if dt := now.Sub(r.last); dt > 0 {
		return r.sum * math.Exp(-float64(dt)/float64(keyRateTau))
	}
	return r.sum
}

// perSecond returns the recent key rate at now.
func (r *keyRate) perSecond(now time.Time) float64 {
	return r.decayed(now) / keyRateTau.Seconds()
}

// fill waits while the queued calls hold fewer than fillKeys keys and the
// recent key rate says the rest will arrive before the first queued call
// has waited fillWait; a call that arrives meanwhile is counted and the
// wait decided again. It reports false if the batcher closed meanwhile.
func (b *batcher) fill() bool {
	if b.fillKeys <= 0 || b.fillWait <= 0 {
		return true
	}
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		now := time.Now()
		b.mu.Lock()
		if len(b.queue) == 0 || b.qkeys >= b.fillKeys {
			b.mu.Unlock()
			return true
		}
		left := b.queue[0].at.Add(b.fillWait).Sub(now)
		short := float64(b.fillKeys - b.qkeys)
		rate := b.rate.perSecond(now)
		b.mu.Unlock()
		if left <= 0 || rate <= 0 || short/rate > left.Seconds() {
			return true
		}
		if t == nil {
			t = time.NewTimer(left)
		} else {
			t.Reset(left)
		}
		select {
		case <-t.C:
			return true
		case <-b.wake:
		case <-b.stop:
			return false
		}
	}
}

// take removes the next batch from the queue: at least one call, then as
// many as fit in maxKeys and maxBytes. Calls whose caller has gone are
// dropped (the caller was told ctx's error and will retry).
func (b *batcher) take() []*pendingAcquire {
	b.mu.Lock()
	defer b.mu.Unlock()
	var batch []*pendingAcquire
	keys, bytes, n := 0, 0, 0
	for n < len(b.queue) {
		p := b.queue[n]
		if p.ctx.Err() != nil {
			n++
			continue
		}
		if len(batch) > 0 && (keys+p.keys > b.maxKeys || bytes+p.bytes > b.maxBytes) {
			break
		}
		batch = append(batch, p)
		keys += p.keys
		bytes += p.bytes
		n++
	}
	for _, p := range b.queue[:n] {
		b.qkeys -= p.keys
	}
	rest := copy(b.queue, b.queue[n:])
	clear(b.queue[rest:])
	b.queue = b.queue[:rest]
	return batch
}

// commit proposes one batch and hands each caller its response or error.
func (b *batcher) commit(batch []*pendingAcquire) {
	keys := 0
	if b.queued != nil {
		now := time.Now()
		for _, p := range batch {
			b.queued(now.Sub(p.at))
		}
	}
	for _, p := range batch {
		keys += p.keys
	}
	data, err := b.encode(batch)
	var res any
	if err == nil {
		res, err = b.propose(data)
	}
	if err == nil {
		br, ok := res.(*state.AcquireBatchResult)
		switch {
		case !ok:
			err = fmt.Errorf("allocator: acquire batch applied with unexpected result %T", res)
		case len(br.Responses) != len(batch) || len(br.Errs) != len(batch):
			err = fmt.Errorf("allocator: acquire batch of %d applied with %d responses and %d errors",
				len(batch), len(br.Responses), len(br.Errs))
		default:
			if b.observe != nil {
				b.observe(len(batch), keys)
			}
			for i, p := range batch {
				p.done <- acquireResult{resp: br.Responses[i], err: br.Errs[i]}
			}
			return
		}
	}
	for _, p := range batch {
		p.done <- acquireResult{err: err}
	}
}

// encode returns the batch's log entry, stamped now.
func (b *batcher) encode(batch []*pendingAcquire) ([]byte, error) {
	if b.legacy {
		reqs := make([]*allotv1.AcquireRequest, len(batch))
		for i, p := range batch {
			reqs[i] = p.req
		}
		data, err := proto.Marshal(&allotv1.Command{
			NowUnixNanos: b.now(),
			Cmd:          &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{Requests: reqs}},
		})
		if err != nil {
			return nil, fmt.Errorf("allocator: encode command: %w", err)
		}
		return data, nil
	}
	n := 24
	recs := make([][]byte, len(batch))
	for i, p := range batch {
		recs[i] = p.rec
		n += len(p.rec)
	}
	return state.AppendAcquireEntry(make([]byte, 0, n), b.now(), recs), nil
}

// close stops the loop, waits for batches in flight, and fails every call
// still queued with errShutdown (none of them was proposed). Safe twice.
func (b *batcher) close() {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return
	}
	b.closed = true
	b.mu.Unlock()
	close(b.stop)
	b.wg.Wait()
	b.mu.Lock()
	queued := b.queue
	b.queue, b.qkeys = nil, 0
	b.mu.Unlock()
	for _, p := range queued {
		p.done <- acquireResult{err: errShutdown}
	}
}
