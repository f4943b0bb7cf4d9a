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
//! - `ns:suspect:<replica>`: set, the holds Redis had at the replica's last renewal that the
//!   replica did not list as live (see [`RENEW`]: released if still unlisted at the next).
//!
//! The scripts that judge or report the whole ledger (a reservation that would be refused,
//! renewals, rebalances, snapshots) first purge up to 32 replicas whose lease has passed: their
//! holds and slices leave the total, so the budget heals without an operator. A reservation
//! that fits, a usage update and a release touch only the replica's own holds and skip it (a
//! purge reads Redis's clock and the lease set: a third of a reservation's cost). The holds hash of a purged
//! replica is named from the namespace inside the script (the same hash tag, so the same slot).
//!
//! Rate windows (exact mode with [`LedgerConfig::rate_limits`](crate::LedgerConfig::rate_limits)):
//!
//! - `ns:rate:limits`: hash `window_us`, `requests`, `tokens` (0: no such window), the limits
//!   every replica of the namespace enforces. Written by the first replica that connects (or by
//!   the first reservation after Redis lost it); a replica whose limits differ is refused
//!   ([`CONFIGURE`], [`RESERVE_RATED`]). No TTL: delete it (with `ns:rate`) to change the limits.
//! - `ns:rate`: hash, per window (`r` requests, `t` tokens) its anchor `<w>o` (microseconds of
//!   Redis's clock) and its theoretical arrival time `<w>tat`, in the window's ticks (a tick is
//!   one unit's share of the window, `window / limit`) since the anchor: the GCRA of the core
//!   crate's `rate` module, on Redis's clock. Its TTL is the time until every window is whole
//!   again plus one window, so an idle window costs nothing (a missing key is a whole window).
//! - `ns:clock`: hash `at` (Redis's time, ms, of the last script that judged the ledger) and
//!   `grace` (the replicas' renewal period plus 100 ms, written by every renewal): a gap
//!   longer than `grace` between two such scripts is time Redis itself did not run (a stall,
//!   a paused process), and every lease deadline moves by the excess before the purge, so a
//!   stall of any length does not lapse a live replica's lease (with a lease of at least
//!   twice the renewal period plus 100 ms: the configuration's default is three periods).
//! - `ns:epoch`: hash `id` (Redis's time in microseconds when the ledger's data was created)
//!   and `open` (Redis's time, ms, before which nothing new is admitted; 0: admitting). Redis
//!   restarted without its data (or emptied) has no epoch: the replica that finds out first
//!   ([`REGISTER`], [`PLAN`]) creates one, and if that replica knew an earlier epoch (so live
//!   holds or slices may exist that Redis forgot), the new epoch opens only after the
//!   recovery period it passes (its renewal period, retry period, two timeouts and 100 ms:
//!   every live replica renews and puts back what it holds within it). Meanwhile reservations
//!   answer "recovering" and slices do not grow. A replica that knew another epoch and
//!   re-registers after a fresh process created the new one (a process that never knew an
//!   epoch opens it at once) moves `open` to its own recovery period from then.
//! - A hold of a rated reservation is `"<held>|<seq>|<charged>"`: `charged` is what the
//!   tokens window was charged for it (the reservation, or more once usage beyond it was
//!   reported), so that its release can give back (or charge) the difference to the usage.
//!
//! A window's ticks are counted from its anchor, which moves by whole windows (and to `now`
//! when the window is whole), so `now - anchor` stays below one window: a tick computation
//! multiplies microseconds below the window by the limit, exact while `window_us * limit` is at
//! most 2^53 (what [`LedgerConfig::validate`](crate::LedgerConfig::validate) checks).
//!
//! Numbers are Lua doubles: exact below 2^53, far above what a budget can hold
//! (`async_bulkhead_llm::limits::MAX_BUDGET` is 2^35 - 1).

/// Shared by every script: the keys, Redis's clock, and the purge of lapsed replicas.
pub const PRELUDE: &str = r#"
local T, L, H, S, W = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local R, C = KEYS[6], KEYS[7]
local ns, replica = ARGV[1], ARGV[2]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- A hold: its tokens, its last usage sequence, what the tokens window was charged for it.
local function hold_of(v)
  local tokens, seq, charged = string.match(v, '^(%d+)|(%d+)|?(%d*)$')
  return tonumber(tokens), tonumber(seq), tonumber(charged) or 0
end
local function hold_value(tokens, seq, charged)
  if charged > 0 then
    return tokens .. '|' .. seq .. '|' .. string.format('%.0f', charged)
  end
  return tokens .. '|' .. seq
end
local function int(x)
  return string.format('%.0f', x)
end
-- The limits stored for the namespace: window (us), requests, tokens (0: none); nil if none.
local function stored_limits()
  if not C then
    return nil
  end
  local v = redis.call('HMGET', C, 'window_us', 'requests', 'tokens')
  if not v[1] then
    return nil
  end
  return tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
end
-- A window of `limit` units per `window_us`, read at `now` (us): its anchor `o`, its tat and
-- the tick `n` now (ticks of window_us / limit since the anchor; now - o < window_us).
local function window(p, limit, window_us, now)
  local v = redis.call('HMGET', R, p .. 'o', p .. 'tat')
  local o, tat = tonumber(v[1]), tonumber(v[2])
  if not o then
    o, tat = now, 0
  end
  local e = math.max(now - o, 0)
  if e >= window_us then
    local k = math.floor(e / window_us)
    o = o + k * window_us
    tat = math.max(tat - k * limit, 0)
    e = e - k * window_us
  end
  local n = math.floor(e * limit / window_us)
  if tat <= n then
    -- Whole: anchored at now, so a burst starts on the call's own instant.
    o, tat, e, n = now, 0, 0, 0
  end
  return {p = p, limit = limit, window_us = window_us, o = o, tat = tat, e = e, n = n}
end
-- Microseconds after the anchor at which tick x starts: ceil(x * window_us / limit).
local function tick_us(w, x)
  local a = math.floor(x / w.limit)
  local b = x - a * w.limit
  return a * w.window_us + math.ceil(b * w.window_us / w.limit)
end
-- nil if `units` fit the window now, else the wait in microseconds until they would (-1: never).
local function refusal(w, units)
  if units > w.limit then
    return -1
  end
  local after = math.max(w.tat, w.n) + units
  if after - w.n <= w.limit then
    return nil
  end
  return tick_us(w, after - w.limit) - w.e
end
local function charge(w, units)
  w.tat = math.max(w.tat, w.n) + units
end
-- Moves tat back by `units` (what a charge added), never below now.
local function give_back(w, units)
  w.tat = math.max(w.tat - units, w.n)
end
-- Writes the windows and sets the key's TTL: until each is whole again, plus one window.
local function save(ws)
  local ttl = 0
  for _, w in ipairs(ws) do
    redis.call('HSET', R, w.p .. 'o', int(w.o), w.p .. 'tat', int(w.tat))
    ttl = math.max(ttl, tick_us(w, w.tat) - w.e + w.window_us)
  end
  if ttl > 0 then
    redis.call('PEXPIRE', R, int(math.ceil(ttl / 1000)))
  end
end
-- Moves the tokens window by `delta` units (usage against what was charged): more is charged
-- without refusal (the tokens were used), less is given back. Nothing without a tokens window.
local function correct(delta)
  if delta == 0 then
    return
  end
  local window_us, _, tokens = stored_limits()
  if not window_us or tokens == 0 then
    return
  end
  local w = window('t', tokens, window_us, now_us())
  if delta > 0 then
    charge(w, delta)
  else
    give_back(w, -delta)
  end
  save({w})
end
-- Releases the holds named in ARGV[from..]: `id`, or `id=<used>` (the call's final usage,
-- input + output: its tokens window charge is corrected to it). Returns {released, freed}.
local function release_ids(from)
  local released, freed = 0, 0
  for i = from, #ARGV do
    local id, used = string.match(ARGV[i], '^(.-)=(%d+)$')
    if not id then
      id = ARGV[i]
    end
    local v = redis.call('HGET', H, id)
    if v then
      local old, _, charged = hold_of(v)
      redis.call('HDEL', H, id)
      released = released + 1
      freed = freed + old
      if used then
        correct(tonumber(used) - charged)
      end
    end
  end
  if freed > 0 then
    redis.call('DECRBY', T, freed)
  end
  return released, freed
end
local function total()
  return tonumber(redis.call('GET', T) or '0')
end
-- Time Redis itself did not run (a stall such as DEBUG SLEEP or a slow fork, a pause of its
-- process) must not lapse leases: their replicas could not renew. Every script that judges the
-- ledger records when it ran (`ns:clock` `at`); a gap since the last one beyond `grace` (the
-- replicas' renewal period plus 100 ms, written by every renewal) moves every lease deadline
-- by the excess. A live replica renews within its period, so in ordinary running no gap
-- exceeds `grace` and lapsed leases age as ever.
local function heal(now)
  local clock = ns .. ':clock'
  local v = redis.call('HMGET', clock, 'at', 'grace')
  local at, grace = tonumber(v[1]), tonumber(v[2])
  redis.call('HSET', clock, 'at', now)
  if not at or not grace or now - at <= grace then
    return 0
  end
  local shift = now - at - grace
  local leases = redis.call('ZRANGE', L, 0, -1, 'WITHSCORES')
  for i = 1, #leases, 2 do
    redis.call('ZADD', L, tonumber(leases[i + 1]) + shift, leases[i])
  end
  return shift
end
-- The recovery gate (`ns:epoch`): `open` while the ledger is recovering (Redis's ms when it
-- admits again), else 0; the first call past `open` clears it.
local function recovering_until()
  local E = ns .. ':epoch'
  local open = tonumber(redis.call('HGET', E, 'open') or '0')
  if open == 0 then
    return 0
  end
  if now_ms() >= open then
    redis.call('HSET', E, 'open', 0)
    return 0
  end
  return open
end
-- Joins the ledger's epoch as a replica that knew epoch `known` ('0': none), with recovery
-- period `quiet` (ms): creates the epoch if Redis has none (recovering for `quiet` if the
-- replica knew one: Redis lost holds it cannot name), or extends the recovery when a replica
-- from an earlier epoch comes back. Returns the epoch's id and `open`.
local function join_epoch(now, known, quiet)
  local E = ns .. ':epoch'
  local v = redis.call('HMGET', E, 'id', 'open')
  local id, open = v[1], tonumber(v[2] or '0')
  if not id then
    local t = redis.call('TIME')
    id = t[1] .. string.format('%06d', tonumber(t[2]))
    open = 0
    if known ~= '0' then
      open = now + quiet
    end
    redis.call('HSET', E, 'id', id, 'open', open)
  elseif known ~= '0' and known ~= id then
    open = math.max(open, now + quiet)
    redis.call('HSET', E, 'open', open)
  end
  if open > 0 and now >= open then
    open = 0
    redis.call('HSET', E, 'open', 0)
  end
  return id, open
end
local function purge(now)
  heal(now)
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
    redis.call('DEL', ns .. ':suspect:' .. r)
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
/// reservation: no round trip of their own; a rider `id=<used>` also corrects the tokens
/// window to the call's usage, see [`RELEASE`]).
/// ARGV: ns, replica, id, tokens, budget, lease_ms, riders....
/// Returns `{outcome, total, budget, purged, released, 0, wait}`: outcome 1 reserved, 0 refused
/// (the total unchanged but for the riders and the purge), -1 the id already holds (nothing
/// changed but for the riders and the purge), -3 Redis does not know the replica (nothing
/// reserved: it re-registers first, [`REGISTER`]), -4 the ledger is recovering from a data
/// loss (nothing reserved; `wait`: the milliseconds until it admits again); purged is the
/// number of lapsed replicas purged (only a reservation that did not fit purges); released the
/// number of riders that held.
pub const RESERVE: &str = r#"
local released = release_ids(7)
local tokens, budget = tonumber(ARGV[4]), tonumber(ARGV[5])
if not redis.call('ZSCORE', L, replica) then
  -- Redis does not know this replica (it restarted without its data, or purged the lease):
  -- nothing new before it re-registers what it still holds (`REGISTER`).
  return {-3, total(), budget, 0, released, 0, 0}
end
local open = recovering_until()
if open > 0 then
  return {-4, total(), budget, 0, released, 0, open - now_ms()}
end
local t = total()
local purged = 0
if t + tokens > budget then
  -- Refused unless lapsed replicas were holding the room.
  purged = purge(now_ms())
  t = total()
  if t + tokens > budget then
    return {0, t, budget, purged, released, 0, 0}
  end
end
if redis.call('HSETNX', H, ARGV[3], ARGV[4] .. '|0') == 0 then
  return {-1, t, budget, purged, released, 0, 0}
end
if not redis.call('ZSCORE', L, replica) then
  redis.call('ZADD', L, now_ms() + tonumber(ARGV[6]), replica)
end
t = redis.call('INCRBY', T, tokens)
return {1, t, budget, purged, released, 0, 0}
"#;

/// Moves admission `id`'s hold to `held` if `seq` is newer than the last applied sequence.
/// With `used` (the call's cumulative usage, input + output) and a tokens window, usage beyond
/// what the window was charged for the call is charged now (without refusal: the tokens were
/// used), as the core crate charges a report beyond the reservation.
/// ARGV: ns, replica, id, seq, held[, used].
/// Returns `{outcome, total, previous hold}`: 1 applied, 0 stale or duplicate (nothing
/// changed), -1 no such hold (released, or purged with its replica's lease).
pub const USAGE: &str = r#"
local v = redis.call('HGET', H, ARGV[3])
if not v then
  return {-1, total(), 0}
end
local old, oldseq, charged = hold_of(v)
if tonumber(ARGV[4]) <= oldseq then
  return {0, total(), old}
end
local used = tonumber(ARGV[6] or '0')
if used > charged then
  correct(used - charged)
  charged = used
end
redis.call('HSET', H, ARGV[3], hold_value(ARGV[5], ARGV[4], charged))
local t = redis.call('INCRBY', T, tonumber(ARGV[5]) - old)
return {1, t, old}
"#;

/// Removes the holds of the admissions named (one or many: a batch of releases is one
/// script). An entry `id=<used>` also corrects the tokens window (if the namespace has one) from
/// what it was charged for the call to `used` (its final usage, input + output): less is given
/// back (`tat` moves back by the difference, never below Redis's now), more is charged.
/// ARGV: ns, replica, id....
/// Returns `{released, total, tokens freed}`: how many of them held (so 1 or 0 for one id).
pub const RELEASE: &str = r#"
local released, freed = release_ids(3)
return {released, total(), freed}
"#;

/// Checks (or first stores) the namespace's rate limits, when a replica connects.
/// ARGV: ns, replica, window_us, requests, tokens (`0 0 0`: the replica has no rate limits).
/// Returns `{1}` when they agree (stored now if there were none and the replica has some), or
/// `{0, window_us, requests, tokens}`: the limits stored, which differ (nothing changed).
pub const CONFIGURE: &str = r#"
local window_us, requests, tokens = stored_limits()
local want = {tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])}
if not window_us then
  if want[1] > 0 then
    redis.call('HSET', C, 'window_us', ARGV[3], 'requests', ARGV[4], 'tokens', ARGV[5])
  end
  return {1}
end
if window_us ~= want[1] or requests ~= want[2] or tokens ~= want[3] then
  return {0, window_us, requests, tokens}
end
return {1}
"#;

/// [`RESERVE`] with rate windows, in the same atomic script: after the riders, the call must
/// fit the requests window (1 unit) and the tokens window (`tokens` units), then the budget;
/// only then are the windows charged and the hold taken. A refusal by a window or by the budget
/// takes nothing (no hold, no charge), so there is nothing to give back. The windows run on
/// Redis's clock (`TIME`, microseconds).
/// ARGV: ns, replica, id, tokens, budget, lease_ms, window_us, requests, tokens_limit
/// (0: no such window), riders....
/// Returns `{outcome, total, budget, purged, released, window, retry_ms}`: the outcomes of
/// [`RESERVE`] (-4's wait in `retry_ms`), or 2 refused by a window (`window` 1 requests, 2 tokens; `retry_ms` the wait
/// until the call would fit if nothing else arrived, in milliseconds rounded up, -1 never:
/// more tokens than the window's limit), or -2 the namespace's stored limits differ from
/// these (nothing changed but for the riders). The limits are stored if Redis lost them.
pub const RESERVE_RATED: &str = r#"
local released = release_ids(10)
local tokens, budget = tonumber(ARGV[4]), tonumber(ARGV[5])
if not redis.call('ZSCORE', L, replica) then
  return {-3, total(), budget, 0, released, 0, 0}
end
local open = recovering_until()
if open > 0 then
  return {-4, total(), budget, 0, released, 0, open - now_ms()}
end
local window_us, lr, lt = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local sw, sr, st = stored_limits()
if not sw then
  redis.call('HSET', C, 'window_us', ARGV[7], 'requests', ARGV[8], 'tokens', ARGV[9])
elseif sw ~= window_us or sr ~= lr or st ~= lt then
  return {-2, total(), budget, 0, released, 0, 0}
end
local now = now_us()
local ws = {}
local asks = {{'r', lr, 1, 1}, {'t', lt, tokens, 2}}
for _, a in ipairs(asks) do
  if a[2] > 0 then
    local w = window(a[1], a[2], window_us, now)
    local wait = refusal(w, a[3])
    if wait then
      if wait >= 0 then
        wait = math.ceil(wait / 1000)
      end
      return {2, total(), budget, 0, released, a[4], wait}
    end
    ws[#ws + 1] = {w, a[3]}
  end
end
local t = total()
local purged = 0
if t + tokens > budget then
  purged = purge(math.floor(now / 1000))
  t = total()
  if t + tokens > budget then
    return {0, t, budget, purged, released, 0, 0}
  end
end
local charged = 0
if lt > 0 then
  charged = tokens
end
if redis.call('HSETNX', H, ARGV[3], hold_value(ARGV[4], '0', charged)) == 0 then
  return {-1, t, budget, purged, released, 0, 0}
end
local saved = {}
for _, x in ipairs(ws) do
  charge(x[1], x[2])
  saved[#saved + 1] = x[1]
end
save(saved)
if not redis.call('ZSCORE', L, replica) then
  redis.call('ZADD', L, math.floor(now / 1000) + tonumber(ARGV[6]), replica)
end
t = redis.call('INCRBY', T, tokens)
return {1, t, budget, purged, released, 0, 0}
"#;

/// Reads the rate windows now: `{window_us, requests limit, requests remaining, requests reset
/// (us), tokens limit, tokens remaining, tokens reset (us)}` (a limit 0: no such window;
/// `window_us` 0: the namespace has no stored limits). Remaining is what the window would let
/// through at once; reset the time until it is whole again. Changes nothing.
pub const RATE_STATUS: &str = r#"
local window_us, lr, lt = stored_limits()
if not window_us then
  return {0, 0, 0, 0, 0, 0, 0}
end
local now = now_us()
local out = {window_us}
for _, a in ipairs({{'r', lr}, {'t', lt}}) do
  if a[2] > 0 then
    local w = window(a[1], a[2], window_us, now)
    local behind = math.min(math.max(w.tat - w.n, 0), a[2])
    local reset = math.max(tick_us(w, w.tat) - w.e, 0)
    out[#out + 1] = a[2]
    out[#out + 1] = a[2] - behind
    out[#out + 1] = reset
  else
    out[#out + 1] = 0
    out[#out + 1] = 0
    out[#out + 1] = 0
  end
end
return out
"#;

/// Renews the replica's lease and reconciles its holds with the replica's live set. ARGV: ns,
/// replica, lease_ms, the renewal period (ms, to set `ns:clock`'s grace), then pairs of an
/// admission id and its hold (`"<held>|<seq>"`): every hold the replica has now.
///
/// Reconciling mends what Redis lost or kept wrongly while the replica was sure of it (a
/// failover to a replica that missed the last writes, in a Redis Cluster or with Sentinel):
/// a live hold Redis does not have is put back; a live hold whose usage sequence is newer than
/// Redis's replaces it; a hold Redis has that the replica does not list is a suspect
/// (`ns:suspect:<replica>`, a set): a reservation whose answer the replica has not read yet, a
/// release on its way, or a release Redis lost. A suspect still unlisted at the next renewal (a
/// renewal period later, longer than the timeout, so any answer has been read and any release
/// sent) was a lost release: it is released. A live set read just before a release that Redis
/// runs before the renewal puts that hold back: the replica releases again, after the
/// renewal's answer, every hold it sent as live and has released since.
///
/// Returns `{lost, total, live replicas, tokens taken off, tokens put back}` (taken off: lost
/// releases released, and holds moved down to a newer usage; put back: lost holds, and holds
/// moved up to a newer usage): lost is 1 when
/// Redis does not know the replica (its lease lapsed and its holds were purged, by this call
/// or an earlier one, or Redis restarted without its data); the lease is then not renewed and
/// nothing reconciled: the replica re-registers with [`REGISTER`], which also registers a new
/// one.
pub const RENEW: &str = r#"
local now = now_ms()
if ARGV[4] then
  redis.call('HSET', ns .. ':clock', 'grace', tonumber(ARGV[4]) + 100)
end
purge(now)
if not redis.call('ZSCORE', L, replica) then
  -- Lapsed (purged) or forgotten (a restart without data): not renewed, so that every later
  -- renewal says so too until the replica re-registers its holds (`REGISTER`), even when
  -- this reply arrives after the replica stopped waiting for it.
  return {1, total(), redis.call('ZCARD', L), 0, 0}
end
redis.call('ZADD', L, now + tonumber(ARGV[3]), replica)
local live = {}
for i = 5, #ARGV - 1, 2 do
  live[ARGV[i]] = ARGV[i + 1]
end
local sk = ns .. ':suspect:' .. replica
local suspect = {}
for _, id in ipairs(redis.call('SMEMBERS', sk)) do
  suspect[id] = true
end
local strays, present = {}, {}
local freed, added = 0, 0
local held = redis.call('HGETALL', H)
for i = 1, #held, 2 do
  local id, v = held[i], held[i + 1]
  present[id] = true
  local mine = live[id]
  if not mine then
    if suspect[id] then
      redis.call('HDEL', H, id)
      freed = freed + hold_of(v)
    else
      strays[#strays + 1] = id
    end
  else
    local tokens, seq, charged = hold_of(v)
    local lt, lseq = hold_of(mine)
    if lseq > seq then
      redis.call('HSET', H, id, hold_value(lt, lseq, charged))
      if lt > tokens then
        added = added + lt - tokens
      else
        freed = freed + tokens - lt
      end
    end
  end
end
for id, v in pairs(live) do
  if not present[id] then
    redis.call('HSET', H, id, v)
    added = added + hold_of(v)
  end
end
redis.call('DEL', sk)
-- In runs of 1,000: Lua's unpack has a bound on how many values it passes.
for i = 1, #strays, 1000 do
  redis.call('SADD', sk, unpack(strays, i, math.min(i + 999, #strays)))
end
if added - freed ~= 0 then
  redis.call('INCRBY', T, added - freed)
end
return {0, total(), redis.call('ZCARD', L), freed, added}
"#;

/// Registers this replica (when it joins, and after Redis lost it: a restart without
/// persistence, a lease that lapsed): its lease, and every hold it still has, and joins the
/// ledger's epoch (`ns:epoch`, created if Redis has none: recovering for the replica's recovery
/// period if the replica knew an earlier one). ARGV: ns, replica, lease_ms, the epoch the
/// replica knew (`0`: none), its recovery period (ms), then pairs of an admission id and its
/// hold (`"<held>|<seq>"`). A hold Redis still has is left as it is.
/// Replies `{tokens added, total, epoch id, wait}` (`wait`: ms until the ledger admits again,
/// 0 if it admits).
pub const REGISTER: &str = r#"
local now = now_ms()
redis.call('ZADD', L, now + tonumber(ARGV[3]), replica)
local id, open = join_epoch(now, ARGV[4], tonumber(ARGV[5]))
local added = 0
for i = 6, #ARGV - 1, 2 do
  if redis.call('HSETNX', H, ARGV[i], ARGV[i + 1]) == 1 then
    added = added + hold_of(ARGV[i + 1])
  end
end
if added > 0 then
  redis.call('INCRBY', T, added)
end
local wait = 0
if open > 0 then
  wait = open - now
end
return {added, total(), tonumber(id), wait}
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
/// It joins the ledger's epoch as [`REGISTER`] does; while the ledger recovers from a data
/// loss, a replica Redis did not know puts back the slice it has installed (`installed`, or
/// its tokens in flight if more: a slice that ended locally still has calls), and no slice
/// grows.
/// ARGV: ns, replica, want, floor, budget, lease_ms, renew_ms, the epoch the replica knew
/// (`0`: none), its recovery period (ms), installed.
/// Returns `{slice, target, total, live leased replicas, lost, epoch id, wait}` (`wait`: ms
/// until the ledger admits again, 0 if it admits).
pub const PLAN: &str = r#"
local now = now_ms()
redis.call('HSET', ns .. ':clock', 'grace', tonumber(ARGV[7]) + 100)
purge(now)
local want, floor, budget = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lost = redis.call('ZADD', L, now + tonumber(ARGV[6]), replica)
redis.call('HSET', W, replica, ARGV[3])
local current = tonumber(redis.call('HGET', S, replica) or '0')
local id, open = join_epoch(now, ARGV[8], tonumber(ARGV[9]))
if open > 0 then
  -- Recovering: what Redis forgot comes back (the slice the replica admits from, or its
  -- calls in flight if more: a slice that ended locally still has them); nothing grows.
  local installed = math.max(tonumber(ARGV[10]), floor)
  if lost == 1 and installed > current then
    redis.call('HSET', S, replica, installed)
    redis.call('INCRBY', T, installed - current)
    current = installed
  end
  return {current, current, total(), redis.call('HLEN', W), lost, tonumber(id), open - now}
end
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
return {grant, target, t, n, lost, tonumber(id), 0}
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
/// seven keys, in this order: `ns:total`, `ns:leases`, `ns:holds:<replica>`, `ns:slices`,
/// `ns:wants`, `ns:rate`, `ns:rate:limits` (the last two are read only by the scripts that
/// touch rate windows, so a caller without them may pass the first five); and `ARGV[1]` =
/// `ns`, `ARGV[2]` = the replica id, then its own arguments.
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
    pub(crate) configure: redis::Script,
    pub(crate) reserve_rated: redis::Script,
    pub(crate) rate_status: redis::Script,
    pub(crate) register: redis::Script,
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
            configure: script(CONFIGURE),
            reserve_rated: script(RESERVE_RATED),
            rate_status: script(RATE_STATUS),
            register: script(REGISTER),
        }
    }
}
