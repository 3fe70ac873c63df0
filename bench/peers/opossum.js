// opossum (npm): a circuit breaker only (opossum has no retry and no budget). success is one
// breaker.fire(); fail_once is a hand-written retry around two fires. Options that differ from
// opossum's defaults, and why: timeout false (the default 10 s timeout arms a timer per call,
// which keel's breaker does not do either), volumeThreshold 10 and errorThresholdPercentage 60
// (with the defaults the first failure of fail_once opens the circuit and every later call
// would be rejected without running, which is not the workload), rollingPercentilesEnabled
// false (the default keeps every latency of the 10 s window and recomputes percentiles, so a
// call costs more the more calls came before it: about 15 us after 1,000 calls and 22 us after
// 3,000 on the reference machine; keel keeps no latency list).
// Usage: node opossum.js [--iterations N] [--runs N]
'use strict';
const CircuitBreaker = require('opossum');
const { parseArgs, dependency, measure, measureSync } = require('./common');

async function main() {
  const { iterations, runs } = parseArgs(process.argv);
  const breaker = new CircuitBreaker(async (fail) => dependency(fail), {
    timeout: false,
    volumeThreshold: 10,
    errorThresholdPercentage: 60,
    rollingPercentilesEnabled: false,
  });
  const workloads = {};
  workloads.floor = measureSync(() => dependency(false), iterations, runs);
  workloads.success = await measure(() => breaker.fire(false), iterations, runs);
  // A rejected fire costs tens of microseconds (an Error with its stack, events): fewer calls.
  workloads.fail_once = await measure(async () => {
    try {
      return await breaker.fire(true);
    } catch {
      return breaker.fire(false);
    }
  }, Math.max(1, Math.floor(iterations / 10)), runs);
  const opened = breaker.opened;
  breaker.shutdown();
  if (opened) {
    console.error('opossum: the circuit opened during the run; the numbers are not comparable');
    process.exit(1);
  }
  console.log(JSON.stringify({
    peer: 'opossum',
    version: require('opossum/package.json').version,
    runtime: `node ${process.versions.node}`,
    composition: 'circuit breaker only (timeout off); fail_once retried by hand',
    workloads,
  }));
}

main().catch((e) => { console.error(e); process.exit(1); });
