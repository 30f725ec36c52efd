// graphile-worker burn-down and latency loop; see run.sh. Usage: bench.js URL JOBS CONCURRENCY SAMPLES
"use strict";
const { run, runMigrations, makeWorkerUtils } = require("graphile-worker");
const { Pool } = require("pg");
const { performance } = require("node:perf_hooks");

const [url, jobs, concurrency, samples] = [
  process.argv[2],
  Number(process.argv[3]),
  Number(process.argv[4]),
  Number(process.argv[5]),
];
const { Logger } = require("@graphile/logger");
const logger = new Logger(() => () => {});

function percentile(sorted, p) {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

async function burnDown(pool) {
  await pool.query(
    "SELECT graphile_worker.add_job('noop', json_build_object('i', i)) FROM generate_series(1, $1) i",
    [jobs],
  );
  let done = 0;
  let first = 0;
  let finish;
  const finished = new Promise((resolve) => (finish = resolve));
  const runner = await run({
    pgPool: pool,
    concurrency,
    noHandleSignals: true,
    pollInterval: 1000,
    logger,
    taskList: {
      noop: async () => {
        if (first === 0) first = performance.now();
        done += 1;
        if (done === jobs) finish();
      },
    },
  });
  await finished;
  // The last completion is written after the handler returns: wait until the queue is empty.
  for (;;) {
    const { rows } = await pool.query("SELECT count(*)::int AS n FROM graphile_worker.jobs");
    if (rows[0].n === 0) break;
    await new Promise((r) => setTimeout(r, 1));
  }
  const seconds = (performance.now() - first) / 1000;
  await runner.stop();
  console.log(
    `graphile-worker burn-down jobs=${jobs} concurrency=${concurrency} (batching off): ${seconds.toFixed(2)}s, ${(jobs / seconds).toFixed(0)} jobs/s`,
  );
}

async function latency(pool) {
  let started;
  const runner = await run({
    pgPool: pool,
    concurrency: 1,
    noHandleSignals: true,
    pollInterval: 1000,
    logger,
    taskList: { ping: async () => started && started(performance.now()) },
  });
  const utils = await makeWorkerUtils({ pgPool: pool, logger });
  const times = [];
  for (let i = 0; i < samples + 10; i++) {
    const startedAt = new Promise((resolve) => (started = resolve));
    const t0 = performance.now();
    await utils.addJob("ping", { i });
    const t1 = await startedAt;
    if (i >= 10) times.push(t1 - t0); // the first 10 warm up
  }
  await utils.release();
  await runner.stop();
  times.sort((a, b) => a - b);
  const f = (x) => x.toFixed(1);
  console.log(
    `graphile-worker latency add_job -> start, ${samples} samples: p50 ${f(percentile(times, 50))} / p95 ${f(percentile(times, 95))} / p99 ${f(percentile(times, 99))} / max ${f(times[times.length - 1])} ms`,
  );
}

(async () => {
  const pool = new Pool({ connectionString: url, max: concurrency + 4 });
  pool.on("error", (err) => console.error("pool error:", err.message));
  pool.on("connect", (client) => client.on("error", (err) => console.error("client error:", err.message)));
  await runMigrations({ pgPool: pool, logger });
  await burnDown(pool);
  await latency(pool);
  await pool.end();
})().catch((err) => {
  console.error(err);
  process.exit(1);
});
