"""The Lua scripts of the Redis limiter (:mod:`gateway.ratelimit.redis_limiter`). Each runs as
one atomic EVALSHA on the single key it is given (a bucket hash, or the epoch marker) and
touches nothing else, so they run on Redis Cluster as on one server; times are the Redis
server's clock (``TIME``), never a gateway's.
"""

from __future__ import annotations

# The epoch marker, alone (KEYS[1]: the marker; ARGV[1]: the epoch this gateway last saw, '' if
# none). Returns the epoch (server ms), creating it when missing (see RedisRateLimiter).
EPOCH_SCRIPT = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  if ARGV[1] == '' then epoch = string.format('%d', now - 60000)
  else epoch = string.format('%d', now) end
  redis.call('SET', KEYS[1], epoch)
end
return epoch
"""

# KEYS[1]: the bucket hash, the only key. ARGV: rpm, tpm (0 = unlimited), the limiter's epoch
# (server ms; '' = unknown: an absent bucket is full), then the script's own arguments.
# Fields: r (requests level), t (tokens level), ts (ms, Redis server time).
_PRELUDE = """
local key = KEYS[1]
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local fresh = 1
if ARGV[3] ~= '' then
  fresh = (now - tonumber(ARGV[3])) / 60000
  if fresh > 1 then fresh = 1 elseif fresh < 0 then fresh = 0 end
end
local s = redis.call('HMGET', key, 'r', 't', 'ts')
local ts = tonumber(s[3]) or now
local dt = now - ts
if dt < 0 then dt = 0 end
local r = nil
local t = nil
if rpm > 0 then
  r = tonumber(s[1])
  if r == nil then r = rpm * fresh else r = math.min(rpm, r + dt * rpm / 60000) end
end
if tpm > 0 then
  t = tonumber(s[2])
  if t == nil then t = tpm * fresh else t = math.min(tpm, t + dt * tpm / 60000) end
end
"""

_SAVE = """
local ttl = 0
redis.call('DEL', key)
if r ~= nil then
  redis.call('HSET', key, 'r', tostring(r))
  ttl = math.max(ttl, (rpm - r) * 60000 / rpm)
end
if t ~= nil then
  redis.call('HSET', key, 't', tostring(t))
  ttl = math.max(ttl, (tpm - t) * 60000 / tpm)
end
redis.call('HSET', key, 'ts', now)
redis.call('PEXPIRE', key, math.ceil(ttl) + 1000)
"""

# ARGV[4]: tokens to charge.
# Returns {allowed, retry_after_ms, code, requests level, tokens level}.
ACQUIRE_SCRIPT = (
    _PRELUDE
    + """
local cost = tonumber(ARGV[4])
local code = 0
local wait_r = 0
local wait_t = 0
if t ~= nil and cost > tpm then
  code = 3
else
  if r ~= nil and r < 1 then wait_r = (1 - r) * 60000 / rpm end
  if t ~= nil and t < cost then wait_t = (cost - t) * 60000 / tpm end
  if wait_r > 0 or wait_t > 0 then
    if wait_r >= wait_t then code = 1 else code = 2 end
  end
end
if code == 0 then
  if r ~= nil then r = r - 1 end
  if t ~= nil then t = t - cost end
end
"""
    + _SAVE
    + """
return {code == 0 and 1 or 0, math.ceil(math.max(wait_r, wait_t)), code,
        tostring(r or ''), tostring(t or '')}
"""
)

# ARGV[4]: requests to give back, ARGV[5]: tokens to give back (negative: charge more).
ADJUST_SCRIPT = (
    _PRELUDE
    + """
local dr = tonumber(ARGV[4])
local dtk = tonumber(ARGV[5])
if r ~= nil then r = math.min(rpm, r + dr) end
if t ~= nil then t = math.min(tpm, t + dtk) end
"""
    + _SAVE
    + """
return 1
"""
)
