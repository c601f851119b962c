"""The Lua scripts of the shared key limits (gateway.admission.shared runs them): each step one
script, atomic on the store, whose clock (``TIME``) every process shares."""

from __future__ import annotations


def arg(value: float | int | None) -> str:
    """A limit as a script's argument: "" for none."""
    return "" if value is None else repr(value)


# The buckets: a hash {t: tokens left, u: when (the store's clock, seconds), r: the rate a second
# they fill at since then}; refilled to now, never over capacity; kept until they would be full
# again. A call with another rate (a reload changed the key's limit) first settles the bucket at the
# rate it had: what the key earned before is not taken back, and the new rate counts from then on.
FILL = """
local now
do local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
-- written in full: Lua's tostring keeps 14 digits, which rounds the clock (10 digits of
-- seconds) to 100 us; a rounding past the next call's clock was forgiven (max(0, ...)), and a
-- key refused thousands of times a second was let through a few percent more than its rate
local function exact(x) return string.format('%.17g', x) end
local function keep(key, tokens, capacity, per_s)
  redis.call('HSET', key, 't', exact(tokens), 'u', exact(now), 'r', exact(per_s))
  redis.call('EXPIRE', key, math.min(math.ceil((capacity - tokens) / per_s) + 1, 2592000))  -- 30 days at most
end
local function fill(key, capacity, per_s)
  local v = redis.call('HMGET', key, 't', 'u', 'r')
  local tokens = tonumber(v[1]) or capacity
  local updated = tonumber(v[2]) or now
  local rate = tonumber(v[3]) or per_s
  local level = math.min(capacity, tokens + math.max(0, now - updated) * rate)
  if v[1] and rate ~= per_s then keep(key, level, capacity, per_s) end
  return level
end
local function opt(x) if x == '' then return nil end return tonumber(x) end
"""

# KEYS: requests, tokens a minute, tokens a day, slots (a sorted set: member -> lease end)
# ARGV: requests_per_minute, burst, tokens_per_minute, tokens_per_day, max_concurrency, member, lease (s)
# Returns: {refused ('' | 'tokens' | 'rate' | 'concurrency'), requests left, minute left, day left}
ADMIT = (
    FILL
    + """
local rpm, burst, tpm, tpd, most = opt(ARGV[1]), opt(ARGV[2]), opt(ARGV[3]), opt(ARGV[4]), opt(ARGV[5])
local refused = ''
local minute, day, left
if tpm then minute = fill(KEYS[2], tpm, tpm / 60) end
if tpd then day = fill(KEYS[3], tpd, tpd / 86400) end
if (minute and minute < 1) or (day and day < 1) then refused = 'tokens' end
if rpm then
  left = fill(KEYS[1], burst, rpm / 60)
  if refused == '' and left < 1 then refused = 'rate' end
end
if most then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if refused == '' and redis.call('ZCARD', KEYS[4]) >= most then refused = 'concurrency' end
end
if refused == '' then
  if rpm then left = left - 1 end
  if most then
    redis.call('ZADD', KEYS[4], now + tonumber(ARGV[7]), ARGV[6])
    redis.call('EXPIRE', KEYS[4], tonumber(ARGV[7]))
  end
end
if rpm then keep(KEYS[1], left, burst, rpm / 60) end
return {refused, tostring(left or -1), tostring(minute or 0), tostring(day or 0)}
"""
)

# KEYS: tokens a minute, tokens a day, visual tokens; ARGV: tokens_per_minute, tokens_per_day,
# visual_tokens_per_minute, the request's visual tokens.
# Returns {refused by the budgets (1/0), refused by the visual bucket, minute left, day left, visual left}
VISUAL = (
    FILL
    + """
local tpm, tpd, vpm, need = opt(ARGV[1]), opt(ARGV[2]), opt(ARGV[3]), tonumber(ARGV[4])
local minute, day, visual
if tpm then minute = fill(KEYS[1], tpm, tpm / 60) end
if tpd then day = fill(KEYS[2], tpd, tpd / 86400) end
local over = (minute and minute < need) or (day and day < need)
local short = 0
if vpm then
  visual = fill(KEYS[3], vpm, vpm / 60)
  if not over and visual >= need then visual = visual - need else short = 1 end
  keep(KEYS[3], visual, vpm, vpm / 60)
end
return {over and 1 or 0, short, tostring(minute or 0), tostring(day or 0), tostring(visual or 0)}
"""
)

# KEYS: tokens a minute, tokens a day, slots; ARGV: tokens_per_minute, tokens_per_day, tokens, member
FINISH = (
    FILL
    + """
local tpm, tpd, spent = opt(ARGV[1]), opt(ARGV[2]), tonumber(ARGV[3])
if spent > 0 and tpm then keep(KEYS[1], fill(KEYS[1], tpm, tpm / 60) - spent, tpm, tpm / 60) end
if spent > 0 and tpd then keep(KEYS[2], fill(KEYS[2], tpd, tpd / 86400) - spent, tpd, tpd / 86400) end
if ARGV[4] ~= '' then redis.call('ZREM', KEYS[3], ARGV[4]) end
return 1
"""
)


# KEYS: the live gateway processes (a sorted set: member -> when its heartbeat lapses)
# ARGV: this process's member, how long its heartbeat holds (s). Returns the live members.
MEMBERS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(ttl) + 1)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


# A process's lease (gateway.admission.leases): requests given back and taken, tokens spent written.
# KEYS: requests, tokens a minute, tokens a day
# ARGV: requests_per_minute, burst, tokens_per_minute, tokens_per_day, requests wanted, requests given
# back, tokens spent. None is taken while a token budget is spent (the key's requests are refused).
# Returns {taken, requests left, minute left, day left}
LEASE = (
    FILL
    + """
local rpm, burst, tpm, tpd = opt(ARGV[1]), opt(ARGV[2]), opt(ARGV[3]), opt(ARGV[4])
local want, back, spent = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local minute, day, left
local taken = 0
if tpm then
  minute = fill(KEYS[2], tpm, tpm / 60)
  if spent > 0 then minute = minute - spent; keep(KEYS[2], minute, tpm, tpm / 60) end
end
if tpd then
  day = fill(KEYS[3], tpd, tpd / 86400)
  if spent > 0 then day = day - spent; keep(KEYS[3], day, tpd, tpd / 86400) end
end
if rpm then
  left = math.min(burst, fill(KEYS[1], burst, rpm / 60) + back)
  if not ((minute and minute < 1) or (day and day < 1)) then
    taken = math.max(0, math.min(want, math.floor(left)))
  end
  left = left - taken
  if taken > 0 or back > 0 then keep(KEYS[1], left, burst, rpm / 60) end
end
return {taken, exact(left or -1), exact(minute or 0), exact(day or 0)}
"""
)
