// Shared measuring loop for the Node.js peers (cockatiel.js, opossum.js): runs a workload
// `runs` times after one warm-up run and prints one JSON object on stdout in the format that
// scripts/bench_report.py reads. Allocations are not counted: V8 exposes no per-call allocation
// count, so allocs_per_call is null.
'use strict';

function parseArgs(argv) {
  const out = { iterations: 200000, runs: 5 };
  for (let i = 2; i < argv.length; i += 2) {
    const flag = argv[i];
    const value = Number(argv[i + 1]);
    if (!['--iterations', '--runs'].includes(flag)) {
      console.error(`unknown flag '${flag}' (expected --iterations N or --runs N)`);
      process.exit(2);
    }
    if (!Number.isInteger(value) || value < 1) {
      console.error(`${flag} needs an integer >= 1, got '${argv[i + 1]}'`);
      process.exit(2);
    }
    out[flag.slice(2)] = value;
  }
  return out;
}

// One uncontended atomic increment per call, as in keel's floor.
const counter = new Int32Array(new SharedArrayBuffer(4));
function dependency(fail) {
  Atomics.add(counter, 0, 1);
  if (fail) throw new Error('transient');
  return 1;
}

// Wall time and process CPU time (all threads: V8's helpers included) per call, per run.
function cpuNs() {
  const u = process.cpuUsage();
  return (u.user + u.system) * 1000;
}

async function measure(fn, iterations, runs) {
  const wall = [];
  const cpu = [];
  for (let r = 0; r <= runs; r++) {
    const c0 = cpuNs();
    const start = process.hrtime.bigint();
    for (let i = 0; i < iterations; i++) await fn();
    const ns = Number(process.hrtime.bigint() - start) / iterations;
    const cns = (cpuNs() - c0) / iterations;
    if (r > 0) {  // run 0 warms the JIT up
      wall.push(ns);
      cpu.push(cns);
    }
  }
  return { ns_per_call: wall, cpu_ns_per_call: cpu, allocs_per_call: null, iterations };
}

function measureSync(fn, iterations, runs) {
  const wall = [];
  const cpu = [];
  let sink = 0;
  for (let r = 0; r <= runs; r++) {
    const c0 = cpuNs();
    const start = process.hrtime.bigint();
    for (let i = 0; i < iterations; i++) sink += fn();
    const ns = Number(process.hrtime.bigint() - start) / iterations;
    const cns = (cpuNs() - c0) / iterations;
    if (r > 0) {
      wall.push(ns);
      cpu.push(cns);
    }
  }
  if (sink === -1) console.error('unreachable');
  return { ns_per_call: wall, cpu_ns_per_call: cpu, allocs_per_call: null, iterations };
}

module.exports = { parseArgs, dependency, measure, measureSync };
