// Times acquire + release of the JavaScript original (npm async-bulkhead-llm@3.17.0), like
// for like with `benches/admission.rs` (group `vs_js`): the same request (no messages), the
// same reservation override (100 input + 1000 max output) against a budget far above what is
// held, 1024 slots, and the same loop shape (`await acquire`, then `release`).
//
// Usage: node bench.mjs <budget|no_budget> [iterations]
// Prints one JSON line: {"case": ..., "ns_per_cycle": ...}.
// Run `sh fetch.sh` first (it unpacks the package into ./node_modules).
import { createLLMBulkhead } from './node_modules/async-bulkhead-llm/dist/esm/index.js';

const withBudget = process.argv[2] !== 'no_budget';
const iterations = Number(process.argv[3] ?? 200000);
const options = { model: 'claude-sonnet-4', maxConcurrent: 1024 };
if (withBudget) options.tokenBudget = { budget: 2 ** 34 };
const bulkhead = createLLMBulkhead(options);
const request = { model: 'claude-sonnet-4', messages: [] };
const acquireOptions = withBudget ? { reservation: { input: 100, maxOutput: 1000 } } : {};

async function cycle() {
  const result = await bulkhead.acquire(request, acquireOptions);
  if (!result.ok) throw new Error(`refused: ${result.reason}`);
  result.token.release();
}

// Warm up the JIT, then measure.
for (let i = 0; i < 20000; i++) await cycle();
const started = process.hrtime.bigint();
for (let i = 0; i < iterations; i++) await cycle();
const ns = Number(process.hrtime.bigint() - started) / iterations;
console.log(JSON.stringify({ case: withBudget ? 'budget' : 'no_budget', ns_per_cycle: ns }));
