"""The Lua scripts of RedisStore (store_redis.py): each critical section of a linear session is one script.

Keys and fields are described in store_redis.py. A script answers -3 (or {-3}) while the session's lock is held
by another request (the store retries it, `_until_free`).
"""

# KEYS: hash, lock. ARGV: owner, lease ms. -> {1, state fields...} | {0} (no session) | {-3} (busy)
LOCK_AND_LOAD = """
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {-3} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {0} end
local state = redis.call('HMGET', KEYS[1], 'version', 'messages', 'ids', 'tools', 'ends', 'not_recorded')
table.insert(state, 1, 1)
return state
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: hash, live[, idem]. ARGV: meta, job, ttl ms, id, expiry ms, idem value, hash key prefix.
# -> nil (created) | the idem value of the live session already holding the key (nothing created)
CREATE = """
if KEYS[3] then
  local held = redis.call('GET', KEYS[3])
  if held and redis.call('EXISTS', ARGV[7] .. string.match(held, '^(%S+)') .. '}') == 1 then return held end
end
redis.call('HSET', KEYS[1], 'meta', ARGV[1], 'job', ARGV[2], 'version', 0, 'messages', '[]', 'ids', '',
  'tools', 'null', 'ends', '[]', 'not_recorded', 0)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[4])
if KEYS[3] then
  redis.call('HSET', KEYS[1], 'idem', KEYS[3])
  redis.call('SET', KEYS[3], ARGV[6], 'PX', ARGV[3])
end
return false
"""
# KEYS: hash. ARGV: token hash. -> meta JSON | nil (no session)
ROTATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSET', KEYS[1], 'token', ARGV[1])
return redis.call('HGET', KEYS[1], 'meta')
"""
# KEYS: hash, records, lock, live, routing. ARGV: version, kept, messages, ids, tools, ends, record, ttl ms, id,
# expiry ms, routing chunk, "1" when the commit carries a chunk
COMMIT = """
if redis.call('EXISTS', KEYS[3]) == 1 then return -3 end
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local version = tonumber(redis.call('HGET', KEYS[1], 'version'))
if version ~= tonumber(ARGV[1]) then
  redis.call('HINCRBY', KEYS[1], 'not_recorded', 1)
  return -2
end
local kept = tonumber(ARGV[2])
if kept == 0 then redis.call('DEL', KEYS[2]) else redis.call('LTRIM', KEYS[2], 0, kept - 1) end
redis.call('RPUSH', KEYS[2], ARGV[7])
if ARGV[12] == '1' then
  if kept == 0 then redis.call('DEL', KEYS[5]) else redis.call('LTRIM', KEYS[5], 0, kept - 1) end
  redis.call('RPUSH', KEYS[5], ARGV[11])
  redis.call('PEXPIRE', KEYS[5], ARGV[8])
end
redis.call('HSET', KEYS[1], 'version', version + 1, 'messages', ARGV[3], 'ids', ARGV[4], 'tools', ARGV[5],
  'ends', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('PEXPIRE', KEYS[2], ARGV[8])
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem then redis.call('PEXPIRE', idem, ARGV[8]) end
redis.call('ZADD', KEYS[4], ARGV[10], ARGV[9])
return version + 1
"""
# KEYS: hash, records, lock, live, routing, nodes, node ids, node routing. ARGV: id. -> 1 deleted | 0 missing | -3 busy
DELETE = """
if redis.call('EXISTS', KEYS[3]) == 1 then return -3 end
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem then redis.call('DEL', idem) end
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
return redis.call('DEL', KEYS[1])
"""
