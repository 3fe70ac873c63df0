// The job-queue peers of scripts/bench-queue.sh: graphile-worker and pg-boss drain a backlog of
// no-op jobs on the same throwaway PostgreSQL server as keel_bench_queue, or measure pickup
// latency (enqueue to handler start) with a producer in the same process. Prints one line in
// keel_bench_queue's format:
//
//   node queue_peer.mjs --peer graphile-worker|pg-boss --db URL [--jobs N] [--workers W]
//                       [--batch B] [--seconds S]
//   node queue_peer.mjs --peer ... --db URL --latency N [--gap-ms G]
//   node queue_peer.mjs --peer ... --db URL --mode enqueue [--jobs N] [--workers W] [--chunk C]
//   node queue_peer.mjs --peer ... --db URL --mode cycle [--jobs N] [--workers W] [--batch B]
//   node queue_peer.mjs --peer ... --db URL --mode soak --rate R [--seconds S] [--workers W]
//                       [--batch B]
//
// --mode enqueue: W loops (one pool) enqueue N jobs, C per call (graphile-worker's addJobs,
// pg-boss's insert; C = 1: addJob and send). --mode cycle: W producer loops enqueue N jobs, B per
// call, while the worker (W slots, batch B as below) drains them; the rate is N over the time
// until the last handler ran. --mode soak: a producer enqueues R jobs a second (every 10 ms its
// share, in bulk) for S seconds while the worker runs; a line a second (soak t=... enqueued=...
// handled=... backlog=...), as keel_bench_queue --soak prints (scripts/bench-soak.sh).
//
// Throughput: N jobs are enqueued first (in bulk), then one worker with W concurrent slots drains
// them until all have run or S seconds have passed; the rate is the handlers that ran over the
// time to the last one. --batch B > 1 turns on what each peer has for batching: graphile-worker's
// local queue (B jobs per fetch per slot) with batched completions (completeJobBatchDelay 0);
// pg-boss's work() with batchSize B and burstWhenBatchFull (fetch again at once while fetches
// come back full). Unbatched, pg-boss runs W loops of fetch, handler, complete, since its work()
// waits at least its shortest poll (0.5 s) after each fetch of one job. Latency: the worker waits on an empty queue
// (both peers are woken by LISTEN/NOTIFY) while N jobs are enqueued one at a time, G ms apart
// (plus up to 20 ms of spread), each carrying Date.now() + performance's sub-ms part.
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
// A package's version from its package.json (neither peer exports that file).
const versionOf = (name) =>
  JSON.parse(readFileSync(new URL(`./node_modules/${name}/package.json`, import.meta.url))).version;

function parseArgs(argv) {
  const out = {
    jobs: 20000, workers: 2, batch: 1, seconds: 3, latency: 0, gapMs: 20, mode: 'drain', chunk: 1,
    rate: 0,
  };
  const names = {
    '--peer': 'peer', '--db': 'db', '--jobs': 'jobs', '--workers': 'workers', '--batch': 'batch',
    '--seconds': 'seconds', '--latency': 'latency', '--gap-ms': 'gapMs', '--mode': 'mode',
    '--chunk': 'chunk', '--rate': 'rate',
  };
  for (let i = 2; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (!key || argv[i + 1] === undefined) {
      console.error(`queue_peer: unknown flag or missing value: ${argv[i]}`);
      process.exit(2);
    }
    out[key] = ['peer', 'db', 'mode'].includes(key) ? argv[i + 1] : Number(argv[i + 1]);
  }
  if (!['graphile-worker', 'pg-boss'].includes(out.peer) || !out.db) {
    console.error('usage: node queue_peer.mjs --peer graphile-worker|pg-boss --db URL ...');
    process.exit(2);
  }
  return out;
}

const nowUs = () => Math.round((performance.timeOrigin + performance.now()) * 1000);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// What each peer needs: setup(), enqueue(payloads), work(handler), stop().
async function graphileWorker(args, batched) {
  const { run, makeWorkerUtils } = require('graphile-worker');
  const utils = await makeWorkerUtils({ connectionString: args.db });
  await utils.migrate();
  // A run starts from an empty queue (jobs left by an earlier run that hit its time limit).
  await utils.withPgClient((client) => client.query('DELETE FROM graphile_worker._private_jobs'));
  let runner;
  return {
    version: versionOf('graphile-worker'),
    enqueue: (payloads) => (payloads.length === 1
      ? utils.addJob('noop', payloads[0])
      : utils.addJobs(payloads.map((p) => ({ identifier: 'noop', payload: p })))),
    async work(handler) {
      const worker = { concurrentJobs: args.workers, pollInterval: 2000 };
      if (batched) {
        worker.localQueue = { size: args.batch * args.workers };
        worker.completeJobBatchDelay = 0;
        worker.failJobBatchDelay = 0;
      }
      runner = await run({
        connectionString: args.db,
        concurrency: args.workers,
        noHandleSignals: true,
        logger: quietLogger(require('graphile-worker').Logger),
        preset: { worker },
        taskList: { noop: async (payload) => handler(payload) },
      });
    },
    async stop() {
      await runner?.stop();
      await utils.release();
    },
  };
}

function quietLogger(Logger) {
  return new Logger(() => (level, message) => {
    if (level === 'error') console.error(message);
  });
}

async function pgBoss(args, batched) {
  const { PgBoss } = await import('pg-boss');
  const boss = new PgBoss({
    connectionString: args.db,
    max: args.workers + 4,
    schedule: false,
    useListenNotify: true,  // with the queue's notify option: workers woken on each insert
  });
  boss.on('error', (e) => console.error(`pg-boss: ${e.message}`));
  await boss.start();
  const queue = `bench_${process.pid}`;
  await boss.createQueue(queue, { notify: true });
  let stopping = false;
  const loops = [];
  return {
    version: versionOf('pg-boss'),
    enqueue: (payloads) => (payloads.length === 1
      ? boss.send(queue, payloads[0])
      : boss.insert(queue, payloads.map((p) => ({ data: p })))),
    async work(handler) {
      if (!batched && !args.latency) {
        // W loops of fetch, handler, complete: work() waits its shortest poll (0.5 s) after
        // every fetch of one job.
        for (let w = 0; w < args.workers; w += 1) {
          loops.push((async () => {
            while (!stopping) {
              const [job] = await boss.fetch(queue);
              if (!job) { await sleep(5); continue; }
              handler(job.data);
              await boss.complete(queue, job.id);
            }
          })());
        }
        return;
      }
      await boss.work(queue, {
        localConcurrency: args.workers, pollingIntervalSeconds: 0.5, batchSize: Math.max(1, args.batch),
        burstWhenBatchFull: true,
      }, async (jobs) => {
        for (const job of jobs) handler(job.data);
      });
    },
    async stop() {
      stopping = true;
      await Promise.all(loops);
      await boss.stop({ graceful: false, wait: true, timeout: 2000 });
    },
  };
}

async function throughput(args, peer) {
  const chunk = 1000;
  for (let done = 0; done < args.jobs; done += chunk) {
    await peer.enqueue(Array.from({ length: Math.min(chunk, args.jobs - done) }, () => ({})));
  }
  let ran = 0;
  let last = 0;
  let finish;
  const finished = new Promise((r) => { finish = r; });
  const start = performance.now();
  await peer.work(() => {
    ran += 1;
    last = performance.now();
    if (ran === args.jobs) finish();
  });
  await Promise.race([finished, sleep(args.seconds * 1000)]);
  const seconds = ((ran > 0 ? last : performance.now()) - start) / 1000;
  await peer.stop();
  console.log(`backend=postgres peer=${args.peer} version=${peer.version} mode=worker` +
    ` batch=${args.batch} workers=${args.workers} jobs=${ran} seconds=${seconds.toFixed(3)}` +
    ` jobs_per_s=${(ran / seconds).toFixed(1)}`);
}

// W loops enqueue N jobs between them, `chunk` per call.
async function produce(args, peer, chunk) {
  let left = args.jobs;
  const loops = [];
  for (let w = 0; w < args.workers; w += 1) {
    loops.push((async () => {
      for (;;) {
        const take = Math.min(chunk, left);
        if (take <= 0) return;
        left -= take;
        await peer.enqueue(Array.from({ length: take }, () => ({})));
      }
    })());
  }
  await Promise.all(loops);
}

async function enqueueOnly(args, peer) {
  await peer.enqueue([{}]);  // the queue exists
  const start = performance.now();
  await produce(args, peer, args.chunk);
  const seconds = (performance.now() - start) / 1000;
  await peer.stop();
  console.log(`backend=postgres peer=${args.peer} version=${peer.version} mode=enqueue` +
    ` chunk=${args.chunk} workers=${args.workers} jobs=${args.jobs} seconds=${seconds.toFixed(3)}` +
    ` jobs_per_s=${(args.jobs / seconds).toFixed(1)}`);
}

async function cycle(args, peer) {
  let ran = 0;
  let finish;
  const finished = new Promise((r) => { finish = r; });
  const start = performance.now();
  await peer.work(() => {
    ran += 1;
    if (ran === args.jobs) finish();
  });
  await produce(args, peer, args.batch);
  await Promise.race([finished, sleep(120000)]);
  const seconds = (performance.now() - start) / 1000;
  await peer.stop();
  console.log(`backend=postgres peer=${args.peer} version=${peer.version} mode=cycle` +
    ` batch=${args.batch} workers=${args.workers} jobs=${ran} seconds=${seconds.toFixed(3)}` +
    ` jobs_per_s=${(ran / seconds).toFixed(1)}`);
}

async function soak(args, peer) {
  let handled = 0;
  let enqueued = 0;
  let stopping = false;
  await peer.work(() => { handled += 1; });
  const start = performance.now();
  const producer = (async () => {
    let owed = 0;
    for (let tick = 1; !stopping; tick += 1) {
      const due = start + tick * 10 - performance.now();
      if (due > 0) await sleep(due);
      owed += args.rate / 100;
      const take = Math.floor(owed);
      if (take === 0) continue;
      owed -= take;
      await peer.enqueue(Array.from({ length: take }, () => ({})));
      enqueued += take;
    }
  })();
  let last = 0;
  for (let t = 1; t <= args.seconds; t += 1) {
    const due = start + t * 1000 - performance.now();
    if (due > 0) await sleep(due);
    console.log(`soak t=${t} enqueued=${enqueued} handled=${handled - last}` +
      ` backlog=${enqueued - handled}`);
    last = handled;
  }
  stopping = true;
  await producer;
  await peer.stop();
  console.log(`backend=postgres peer=${args.peer} version=${peer.version} mode=soak` +
    ` rate=${args.rate} batch=${args.batch} workers=${args.workers} enqueued=${enqueued}` +
    ` handled=${handled} seconds=${args.seconds}`);
}

async function latency(args, peer) {
  await peer.enqueue([{ t: 0 }]);  // the queue exists and the worker has something to start on
  const samples = [];
  let finish;
  const finished = new Promise((r) => { finish = r; });
  await peer.work((payload) => {
    if (!payload.t) return;
    samples.push((nowUs() - payload.t) / 1000);
    if (samples.length === args.latency) finish();
  });
  await sleep(500);  // the worker is idle
  for (let i = 0; i < args.latency; i += 1) {
    await sleep(args.gapMs + Math.floor(Math.random() * 21));
    await peer.enqueue([{ t: nowUs() }]);
  }
  await Promise.race([finished, sleep(5000)]);
  await peer.stop();
  samples.sort((a, b) => a - b);
  const at = (f) => samples[Math.min(samples.length - 1, Math.floor(f * samples.length))];
  console.log(`backend=postgres peer=${args.peer} version=${peer.version} mode=latency` +
    ` producer=thread jobs=${samples.length} gap_ms=${args.gapMs} median_ms=${at(0.5).toFixed(2)}` +
    ` p90_ms=${at(0.9).toFixed(2)} p99_ms=${at(0.99).toFixed(2)}` +
    ` max_ms=${samples[samples.length - 1].toFixed(2)}`);
}

const args = parseArgs(process.argv);
const make = args.peer === 'graphile-worker' ? graphileWorker : pgBoss;
const peer = await make(args, args.batch > 1);
if (args.latency > 0) {
  await latency(args, peer);
} else if (args.mode === 'enqueue') {
  await enqueueOnly(args, peer);
} else if (args.mode === 'cycle') {
  await cycle(args, peer);
} else if (args.mode === 'soak') {
  await soak(args, peer);
} else {
  await throughput(args, peer);
}
process.exit(0);
