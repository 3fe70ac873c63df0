// cenkalti/backoff (Debian golang-github-cenkalti-backoff-dev, v4): retry only (the library has
// no circuit breaker and no budget). Workloads as in bench/peer_compare_bench.cpp:
//
//	floor      bare call of the dependency (one atomic.AddInt64)
//	success    RetryNotifyWithTimer with WithMaxRetries(NewExponentialBackOff(), 2): 3 attempts
//	fail_once  the operation fails once, then succeeds; the computed delay is not waited: a
//	           timer that fires at once stands in for the real one, as keel's ManualClock does
//
// Allocations per call come from runtime.MemStats.Mallocs. Built offline in GOPATH mode against
// /usr/share/gocode by scripts/bench.sh.
//
// Usage: cenkalti-peer [-iterations N] [-runs N]
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cenkalti/backoff"
)

// version is set at build time by scripts/bench.sh (-ldflags "-X main.version=...").
var version = "v4"

var calls int64

var errTransient = errors.New("transient")

//go:noinline
func dependency(fail bool) error {
	atomic.AddInt64(&calls, 1)
	if fail {
		return errTransient
	}
	return nil
}

// instantTimer fires as soon as it is started.
type instantTimer struct{ c chan time.Time }

func (t *instantTimer) Start(time.Duration) { t.c <- time.Time{} }
func (t *instantTimer) Stop() {
	select {
	case <-t.c:
	default:
	}
}
func (t *instantTimer) C() <-chan time.Time { return t.c }

type workload struct {
	NsPerCall     []float64 `json:"ns_per_call"`
	CPUNsPerCall  []float64 `json:"cpu_ns_per_call"`
	AllocsPerCall float64   `json:"allocs_per_call"`
	Iterations    int       `json:"iterations"`
}

// cpuNanos is the process's CPU time (user + system, all threads: the GC's included).
func cpuNanos() int64 {
	var u syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &u); err != nil {
		return 0
	}
	return u.Utime.Nano() + u.Stime.Nano()
}

func measure(fn func() error, iterations, runs int) workload {
	w := workload{Iterations: iterations}
	var before, after runtime.MemStats
	var mallocs uint64
	for r := 0; r <= runs; r++ {
		runtime.ReadMemStats(&before)
		cpuStart := cpuNanos()
		start := time.Now()
		for i := 0; i < iterations; i++ {
			if err := fn(); err != nil {
				fmt.Fprintln(os.Stderr, "cenkalti-peer: unexpected error:", err)
				os.Exit(1)
			}
		}
		elapsed := time.Since(start)
		cpu := cpuNanos() - cpuStart
		runtime.ReadMemStats(&after)
		if r > 0 { // run 0 warms caches up
			w.NsPerCall = append(w.NsPerCall, float64(elapsed.Nanoseconds())/float64(iterations))
			w.CPUNsPerCall = append(w.CPUNsPerCall, float64(cpu)/float64(iterations))
			mallocs += after.Mallocs - before.Mallocs
		}
	}
	w.AllocsPerCall = float64(mallocs) / float64(iterations*runs)
	return w
}

func main() {
	iterations := flag.Int("iterations", 1000000, "calls per run (>= 1)")
	runs := flag.Int("runs", 5, "measured runs (>= 1)")
	flag.Parse()
	if *iterations < 1 || *runs < 1 {
		fmt.Fprintf(os.Stderr, "cenkalti-peer: -iterations and -runs need integers >= 1 (got %d, %d)\n",
			*iterations, *runs)
		os.Exit(2)
	}
	policy := backoff.WithMaxRetries(backoff.NewExponentialBackOff(), 2)
	timer := &instantTimer{c: make(chan time.Time, 1)}

	workloads := map[string]workload{}
	workloads["floor"] = measure(func() error { return dependency(false) }, *iterations, *runs)
	success := func() error { return dependency(false) }
	workloads["success"] = measure(func() error {
		return backoff.RetryNotifyWithTimer(success, policy, nil, timer)
	}, *iterations, *runs)
	workloads["fail_once"] = measure(func() error {
		attempt := 0
		return backoff.RetryNotifyWithTimer(func() error {
			attempt++
			return dependency(attempt == 1)
		}, policy, nil, timer)
	}, *iterations, *runs)

	out, err := json.Marshal(map[string]any{
		"peer":        "cenkalti/backoff",
		"version":     version,
		"runtime":     runtime.Version(),
		"composition": "RetryNotifyWithTimer(WithMaxRetries(NewExponentialBackOff(), 2)); no breaker, no budget",
		"workloads":   workloads,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "cenkalti-peer:", err)
		os.Exit(1)
	}
	fmt.Println(string(out))
}
