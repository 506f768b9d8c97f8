-- ExtendLease. ARGV: 1 lease ms, 2.. lease ids. A live lease (even one past its expiry that was not yet
-- reaped) gets expiry now + lease ms; others are reported as expired.
-- Returns {status, num_extended, lease_expires_ms, expired lease ids...}; status NOJOB|OK.
if not job_exists() then
  return {'NOJOB', 0, 0}
end
local expires = now_ms() + tonumber(ARGV[1])
local reply = {'OK', 0, expires}
local extended = 0
for i = 2, #ARGV do
  if redis.call('HEXISTS', K_LEASES, ARGV[i]) == 1 then
    redis.call('ZADD', K_EXPIRY, expires, ARGV[i])
    extended = extended + 1
  else
    reply[#reply + 1] = ARGV[i]
  end
end
reply[2] = extended
return reply
