//! The ledger's Lua scripts (public so that operators can read and audit the protocol, and
//! tests can drive it directly): every change to the shared budget is one script, run atomically
//! by Redis, so no two replicas ever see half of another's change.
//!
//! The keys of one ledger (its namespace `ns`, a hash tag such as `{llm-budget}` so that a
//! cluster keeps them on one slot):
//!
//! - `ns:total`: the sum of every live hold and slice (an integer string).
//! - `ns:leases`: sorted set, replica id -> lease deadline in milliseconds of Redis's own clock
//!   (`TIME`), so the replicas' clocks never matter.
//! - `ns:holds:<replica>`: hash, admission id -> `"<held tokens>|<usage sequence>"`, the exact
//!   mode's holds of one replica.
//! - `ns:slices` / `ns:wants`: hashes, replica id -> the slice it leases / the tokens it asked
//!   for at its last rebalance (leased mode).
//!
//! The scripts that judge or report the whole ledger (a reservation that would be refused,
//! renewals, rebalances, snapshots) first purge up to 32 replicas whose lease has passed: their
//! holds and slices leave the total, so the budget heals without an operator. A reservation
//! that fits, a usage update and a release touch only the replica's own holds and skip it (a
//! purge reads Redis's clock and the lease set: a third of a reservation's cost). The holds hash of a purged
//! replica is named from the namespace inside the script (the same hash tag, so the same slot).
//!
//! Numbers are Lua doubles: exact below 2^53, far above what a budget can hold
//! (`async_bulkhead_llm::limits::MAX_BUDGET` is 2^35 - 1).

/// Shared by every script: the keys, Redis's clock, and the purge of lapsed replicas.
pub const PRELUDE: &str = r#"
local T, L, H, S, W = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ns, replica = ARGV[1], ARGV[2]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function hold_of(v)
  local tokens, seq = string.match(v, '^(%d+)|(%d+)$')
  return tonumber(tokens), tonumber(seq)
end
local function total()
  return tonumber(redis.call('GET', T) or '0')
end
local function purge(now)
  local dead = redis.call('ZRANGEBYSCORE', L, '-inf', '(' .. now, 'LIMIT', 0, 32)
  local freed = 0
  for _, r in ipairs(dead) do
    local hk = ns .. ':holds:' .. r
    for _, v in ipairs(redis.call('HVALS', hk)) do
      local tokens = hold_of(v)
      freed = freed + tokens
    end
    freed = freed + tonumber(redis.call('HGET', S, r) or '0')
    redis.call('DEL', hk)
    redis.call('HDEL', S, r)
    redis.call('HDEL', W, r)
    redis.call('ZREM', L, r)
  end
  if freed > 0 then
    redis.call('DECRBY', T, freed)
  end
  return #dead
end
"#;

/// Reserves `tokens` for admission `id` if the total stays within `budget`, after releasing
/// the holds named in `riders` (releases waiting on this replica ride on its next
/// reservation: no round trip of their own).
/// ARGV: ns, replica, id, tokens, budget, lease_ms, riders....
/// Returns `{outcome, total, budget, purged, released}`: outcome 1 reserved, 0 refused (the
/// total unchanged but for the riders and the purge), -1 the id already holds (nothing
/// changed but for the riders and the purge); purged is the number of lapsed replicas purged
/// (only a reservation that did not fit purges); released the number of riders that held.
pub const RESERVE: &str = r#"
local released = 0
for i = 7, #ARGV do
  local v = redis.call('HGET', H, ARGV[i])
  if v then
    local old = hold_of(v)
    redis.call('HDEL', H, ARGV[i])
    redis.call('DECRBY', T, old)
    released = released + 1
  end
end
local tokens, budget = tonumber(ARGV[4]), tonumber(ARGV[5])
local t = total()
local purged = 0
if t + tokens > budget then
  -- Refused unless lapsed replicas were holding the room.
  purged = purge(now_ms())
  t = total()
  if t + tokens > budget then
    return {0, t, budget, purged, released}
  end
end
if redis.call('HSETNX', H, ARGV[3], ARGV[4] .. '|0') == 0 then
  return {-1, t, budget, purged, released}
end
if not redis.call('ZSCORE', L, replica) then
  redis.call('ZADD', L, now_ms() + tonumber(ARGV[6]), replica)
end
t = redis.call('INCRBY', T, tokens)
return {1, t, budget, purged, released}
"#;

/// Moves admission `id`'s hold to `held` if `seq` is newer than the last applied sequence.
/// ARGV: ns, replica, id, seq, held.
/// Returns `{outcome, total, previous hold}`: 1 applied, 0 stale or duplicate (nothing
/// changed), -1 no such hold (released, or purged with its replica's lease).
pub const USAGE: &str = r#"
local v = redis.call('HGET', H, ARGV[3])
if not v then
  return {-1, total(), 0}
end
local old, oldseq = hold_of(v)
if tonumber(ARGV[4]) <= oldseq then
  return {0, total(), old}
end
redis.call('HSET', H, ARGV[3], ARGV[5] .. '|' .. ARGV[4])
local t = redis.call('INCRBY', T, tonumber(ARGV[5]) - old)
return {1, t, old}
"#;

/// Removes the holds of the admissions named (one or many: a batch of releases is one
/// script). ARGV: ns, replica, id....
/// Returns `{released, total, tokens freed}`: how many of them held (so 1 or 0 for one id).
pub const RELEASE: &str = r#"
local released, freed = 0, 0
for i = 3, #ARGV do
  local v = redis.call('HGET', H, ARGV[i])
  if v then
    local old = hold_of(v)
    redis.call('HDEL', H, ARGV[i])
    released = released + 1
    freed = freed + old
  end
end
local t = total()
if freed > 0 then
  t = redis.call('DECRBY', T, freed)
end
return {released, t, freed}
"#;

/// Renews the replica's lease. ARGV: ns, replica, lease_ms.
/// Returns `{lost, total, live replicas}`: lost is 1 when the lease had lapsed (its holds and
/// slice were purged, by this call or an earlier one) and the replica joins again with none.
pub const RENEW: &str = r#"
local now = now_ms()
purge(now)
local lost = redis.call('ZADD', L, now + tonumber(ARGV[3]), replica)
return {lost, total(), redis.call('ZCARD', L)}
"#;

/// Removes the replica at once: its lease, holds and slice (a graceful shutdown).
/// ARGV: ns, replica. Returns `{tokens freed, total}`.
pub const LEAVE: &str = r#"
local now = now_ms()
purge(now)
local before = total()
if redis.call('ZSCORE', L, replica) then
  redis.call('ZADD', L, 0, replica)
  purge(now)
end
local t = total()
return {before - t, t}
"#;

/// Leased mode, the growing half of a rebalance: renews the lease, records `want`, computes
/// the replica's target (every replica's want up to the fair share, then what is left shared
/// in proportion to what each asked above it) and grows the slice toward
/// `max(target, floor)` as far as the budget allows. Never shrinks (a replica shrinks its
/// local budget first, then calls SHRINK). `floor` is the tokens the replica holds in flight.
/// ARGV: ns, replica, want, floor, budget, lease_ms.
/// Returns `{slice, target, total, live leased replicas, lost}`.
pub const PLAN: &str = r#"
local now = now_ms()
purge(now)
local want, floor, budget = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lost = redis.call('ZADD', L, now + tonumber(ARGV[6]), replica)
redis.call('HSET', W, replica, ARGV[3])
local current = tonumber(redis.call('HGET', S, replica) or '0')
local sum_slices = 0
local slices = redis.call('HVALS', S)
for _, v in ipairs(slices) do
  sum_slices = sum_slices + tonumber(v)
end
local t = total()
local avail = budget - (t - sum_slices)
if avail < 0 then
  avail = 0
end
local wants = redis.call('HVALS', W)
local n = #wants
local fair = math.floor(avail / n)
local base, excess = 0, 0
for _, v in ipairs(wants) do
  local w = tonumber(v)
  base = base + math.min(w, fair)
  excess = excess + math.max(w - fair, 0)
end
local target = math.min(want, fair)
if want > fair and excess > 0 then
  local spare = avail - base
  if spare > 0 then
    target = target + math.floor(spare * ((want - fair) / excess))
  end
end
local wanted = math.max(target, floor)
local room = budget - (t - current)
local grant = current
if wanted > current and room > current then
  grant = math.min(wanted, room)
end
if grant ~= current then
  redis.call('HSET', S, replica, grant)
  t = redis.call('INCRBY', T, grant - current)
end
return {grant, target, t, n, lost}
"#;

/// Leased mode, the shrinking half: lowers the slice to `value` (never raises it).
/// ARGV: ns, replica, value. Returns `{slice, total}`.
pub const SHRINK: &str = r#"
local current = tonumber(redis.call('HGET', S, replica) or '0')
local value = tonumber(ARGV[3])
local t = total()
if value < current then
  redis.call('HSET', S, replica, value)
  t = redis.call('DECRBY', T, current - value)
  current = value
end
return {current, t}
"#;

/// Reads the ledger: `{total, live replicas, leased replicas}` (after the purge).
pub const SNAPSHOT: &str = r#"
purge(now_ms())
return {total(), redis.call('ZCARD', L), redis.call('HLEN', W)}
"#;

/// A script's full source: [`PRELUDE`] followed by its body. Every script takes the same
/// five keys, in this order: `ns:total`, `ns:leases`, `ns:holds:<replica>`, `ns:slices`,
/// `ns:wants`; and `ARGV[1]` = `ns`, `ARGV[2]` = the replica id, then its own arguments.
pub fn source(body: &str) -> String {
    format!("{PRELUDE}{body}")
}

/// The scripts, loaded once (`EVALSHA`, falling back to `EVAL` after a restart or a
/// `SCRIPT FLUSH`: `redis::Script` does it).
pub(crate) struct Scripts {
    pub(crate) reserve: redis::Script,
    pub(crate) usage: redis::Script,
    pub(crate) release: redis::Script,
    pub(crate) renew: redis::Script,
    pub(crate) leave: redis::Script,
    pub(crate) plan: redis::Script,
    pub(crate) shrink: redis::Script,
    pub(crate) snapshot: redis::Script,
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        let script = |body: &str| redis::Script::new(&source(body));
        Scripts {
            reserve: script(RESERVE),
            usage: script(USAGE),
            release: script(RELEASE),
            renew: script(RENEW),
            leave: script(LEAVE),
            plan: script(PLAN),
            shrink: script(SHRINK),
            snapshot: script(SNAPSHOT),
        }
    }
}
