// cockatiel (npm): retry (3 attempts in all, its default zero backoff) wrapped around a circuit
// breaker (5 consecutive failures), the closest cockatiel composition to keel's retry + breaker.
// cockatiel has no retry budget. Workloads as in bench/peer_compare_bench.cpp:
//   floor      bare synchronous call (one Atomics.add)
//   success    await policy.execute(call) that succeeds
//   fail_once  the call throws once, then succeeds; cockatiel waits its zero delay through
//              setTimeout(0), which Node runs no sooner than the next timer tick
// Usage: node cockatiel.js [--iterations N] [--runs N]
'use strict';
const { retry, circuitBreaker, wrap, handleAll, ConsecutiveBreaker } = require('cockatiel');
const { parseArgs, dependency, measure, measureSync } = require('./common');

async function main() {
  const { iterations, runs } = parseArgs(process.argv);
  const breaker = circuitBreaker(handleAll, {
    halfOpenAfter: 10000,
    breaker: new ConsecutiveBreaker(5),
  });
  const policy = wrap(retry(handleAll, { maxAttempts: 2 }), breaker);

  const workloads = {};
  workloads.floor = measureSync(() => dependency(false), iterations, runs);
  workloads.success = await measure(() => policy.execute(() => dependency(false)), iterations, runs);
  // Each retry waits for a timer tick (about 1 ms), so this workload runs far fewer iterations.
  const slow = Math.max(1, Math.floor(iterations / 500));
  workloads.fail_once = await measure(() => {
    let attempt = 0;
    return policy.execute(() => dependency(attempt++ === 0));
  }, slow, runs);
  const version = require('cockatiel/package.json').version;
  console.log(JSON.stringify({
    peer: 'cockatiel',
    version,
    runtime: `node ${process.versions.node}`,
    composition: 'retry(maxAttempts 2) + circuitBreaker(ConsecutiveBreaker 5); no budget',
    workloads,
  }));
}

main().catch((e) => { console.error(e); process.exit(1); });
